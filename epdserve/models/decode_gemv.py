"""Decode-sized projections (M <= 4 rows) as one Triton GEMV that loads its whole weight slice before it waits for
the kernel before it, optionally with the RMSNorm (and residual add) in front of the projection folded in.

Why (issue 44): at batch 1 the 3B preset's qkv (10.5 MB of weights) and o (8.4 MB) projections took 6.1 us each
in cuBLAS on an H200, 1.4-1.7 TB/s, and each of the two fused add + RMSNorm kernels around them another 2.5 us
(docs/performance.md, ninth session): a kernel's fixed cost (launch, the DRAM latency of its first loads, its
tail) and not the bandwidth sets their time. Here each program holds ``BN`` output columns over the whole K in
registers: it loads them under programmatic dependent launch (PDL, :func:`epdserve.device.supports_pdl`) *before*
``griddepcontrol.wait``, so the weights stream in while the previous kernel still runs (weights are never
written), and after the wait only the activation row (a few KB, from L2) and the products remain. With the norm
folded in, every program recomputes the row's RMS from ``x (+ residual)``, which costs a K-element reduction per
program and removes a kernel. This is the weight prefetch of Hazy Research's decode megakernel ("Look Ma, No
Bubbles", 2025) applied kernel by kernel.

Arithmetic, as the unfused CUDA path computes it (flashinfer's ``fused_add_rmsnorm`` then ``F.linear``):
``s = x + residual`` in float32, stored rounded as the new residual; ``n = s * rsqrt(mean(s^2) + eps) * gamma`` in
float32 over the unrounded ``s``, rounded to the activation dtype; ``y = n @ W.T (+ bias)`` accumulated in float32
and rounded once. So the result differs from the unfused one only by the summation orders (one ulp of the
activation dtype where a sum lands near a rounding boundary).

At one row the down projection (K = the MLP's width, too wide for one program's registers) runs split-K:
:func:`down_parts` gives each program ``BN`` columns of one ``SPLIT_K``-wide slice of K, loaded before the wait, and
writes float32 partial products ``[S, M, N]``; the next block's :func:`norm_gemv` sums them (rounded once to the
activation dtype, as cuBLAS rounds its output) before the residual add, and whatever else takes a block's output
calls :func:`merge_parts`. This replaces cuBLAS's split-K GEMM and its separate reduce kernel: the 3B preset's
decode step at one row took 0.96x the time on an H200 (docs/performance.md, fifteenth session).

Shapes and dtypes: ``x`` ``[M, K]`` with ``M <= MAX_M`` and ``K <= MAX_K``; ``w`` ``[N, K]``; output ``[M, N]``
in ``x``'s dtype. bf16/fp16 on CUDA (float32 too on the CPU, through Triton's interpreter, for the tests). One
launch, grid ``cdiv(N, BN)``; CUDA-graph safe. Callers check :func:`fits` and fall back to the unfused path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from epdserve.device import supports_pdl

MAX_M = 4  # rows per call; each row is a separate pass over the registers' weights
# Rows up to which a decoder layer folds its two add + RMSNorm kernels into the projections after them. Measured on
# an H200 (3B preset, decode step GPU time, the folded norms alone against the unfolded path): 0.98x at 1 row, but
# 1.05x at 2 and 1.12x at 4, where each row's two block-wide reductions (its RMS, then the products) run one after
# another.
FOLD_NORMS_MAX_M = 1
# The whole K of a program's columns sits in registers (BN * K * 2 bytes per program). At K = 3584 and 4096 (the 7B
# and 8B presets' hidden size) a program needs 8 warps and ~230 registers a thread, one program fits an SM, and the
# decode step was slower than cuBLAS's: 1.18x at 1 row on the 7B preset (H200). Those keep the cuBLAS path.
MAX_K = 2048

_CUDA_DTYPES = (torch.bfloat16, torch.float16)
_CPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# The split-K down projection: K per program and columns per program (32 KB of bf16 weights a program, as for qkv
# and o). The 3B preset's K = 11008 in 3 parts: its decode step at one row took 1.971 ms of GPU time on an H200
# against 1.985 in 6 parts of 2048 x 8 columns, and 2.069 in 6 parts of 2048 x 16 columns over 8 warps
# (docs/performance.md, eighteenth session); the next block sums half as many parts.
SPLIT_K, SPLIT_BN = 4096, 4

# Launch shape: 8 output columns per program over 4 warps (32 KB of bf16 weights at K = 2048, 64 registers a thread).
# On an H200 (3B preset, qkv and o at K = 2048) 4 x 4, 8 x 8 and 16 x 8 (columns x warps) were no faster.
BLOCK_N, NUM_WARPS = 8, 4


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` / :func:`norm_gemv` take ``x`` ``[M, K]`` and ``w`` ``[N, K]``: CUDA, bf16/fp16 of one
    dtype, ``1 <= M <= MAX_M``, ``K <= MAX_K``, rows contiguous."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.shape[1] <= MAX_K
            and x.dtype in _CUDA_DTYPES and w.dtype == x.dtype and w.dim() == 2 and w.shape[1] == x.shape[1]
            and x.stride(1) == 1 and w.stride(1) == 1)


@functools.cache
def _kernel():
    """The jitted ``(norm_gemv_kernel, gemv_parts_kernel, norm_parts_kernel)``; Triton imported on first use."""
    import triton
    import triton.language as tl

    return _norm_gemv_kernel(triton, tl), _parts_kernel(triton, tl), _norm_parts_kernel(triton, tl)


def _norm_gemv_kernel(triton, tl):
    @triton.jit
    def norm_gemv_kernel(x, S: tl.constexpr, r, r_out, n_out, gamma, w, bias, y, M, N, K, eps, x_stride,
                         x_part_stride, r_stride, w_stride, y_stride, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr, NORMED: tl.constexpr,
                         BIAS: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        cols = pid * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        col_ok, k_ok = cols < N, ks < K
        # Everything that does not depend on the previous kernel first: the weight slice, bias and norm weight.
        wt = tl.load(w + cols[:, None].to(tl.int64) * w_stride + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                     other=0.0)
        b = tl.full((BN,), 0.0, tl.float32)
        if BIAS:
            b = tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = tl.full((BK,), 0.0, tl.float32)
        if NORM:
            g = tl.load(gamma + ks, mask=k_ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dt = y.dtype.element_ty
        for m in tl.static_range(BM):
            if m < M:
                # x: S >= 1 parts summed in float32 and rounded once (S = 1, x in the activation dtype: exact)
                v = tl.full((BK,), 0.0, tl.float32)
                for p in tl.static_range(S):
                    v += tl.load(x + p * x_part_stride + m * x_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
                v = v.to(dt).to(tl.float32)
                if RESID:
                    v += tl.load(r + m * r_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
                    if pid == 0:
                        tl.store(r_out + m * K + ks, v.to(dt), mask=k_ok)
                # (reductions through tl.sum's own combine function: tl.sum does not run on the CPU interpreter)
                if NORM:  # flashinfer's order: s * rsqrt(mean(s^2) + eps) * gamma, over the unrounded sum
                    ss = tl.reduce(v * v, 0, tl.standard._sum_combine)
                    v = (v * tl.rsqrt(ss / K + eps) * g).to(dt).to(tl.float32)
                    if NORMED:
                        if pid == 0:
                            tl.store(n_out + m * K + ks, v.to(dt), mask=k_ok)
                acc = tl.reduce(wt.to(tl.float32) * v[None, :], 1, tl.standard._sum_combine) + b
                tl.store(y + m * y_stride + cols, acc.to(dt), mask=col_ok)

    return norm_gemv_kernel


def _parts_kernel(triton, tl):
    @triton.jit
    def gemv_parts_kernel(x, w, parts, M, N, K, x_stride, w_stride, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, PDL: tl.constexpr):
        # program (n, p): BN columns over K slice p, whose weights load before the wait; float32 partials out
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        p = tl.program_id(1)
        ks = p * BK + tl.arange(0, BK)
        col_ok, k_ok = cols < N, ks < K
        wt = tl.load(w + cols[:, None].to(tl.int64) * w_stride + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                     other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for m in tl.static_range(BM):
            if m < M:
                v = tl.load(x + m * x_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
                acc = tl.reduce(wt.to(tl.float32) * v[None, :], 1, tl.standard._sum_combine)
                tl.store(parts + (p * M + m) * N + cols, acc, mask=col_ok)

    return gemv_parts_kernel


def _norm_parts_kernel(triton, tl):
    @triton.jit
    def norm_parts_kernel(x, S: tl.constexpr, x_part_stride, r, gamma, y, r_out, K, eps, BK: tl.constexpr,
                          R_OUT: tl.constexpr, PDL: tl.constexpr):
        # program m: row m's parts summed, rounded, plus the residual (stored rounded with R_OUT, as
        # norm_gemv_kernel's r_out); RMSNorm as norm_gemv_kernel's, over the unrounded sum
        m = tl.program_id(0)
        ks = tl.arange(0, BK)
        k_ok = ks < K
        g = tl.load(gamma + ks, mask=k_ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dt = y.dtype.element_ty
        v = tl.full((BK,), 0.0, tl.float32)
        for p in tl.static_range(S):
            v += tl.load(x + p * x_part_stride + m * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        v = v.to(dt).to(tl.float32) + tl.load(r + m * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        if R_OUT:
            tl.store(r_out + m * K + ks, v.to(dt), mask=k_ok)
        ss = tl.reduce(v * v, 0, tl.standard._sum_combine)
        tl.store(y + m * K + ks, (v * tl.rsqrt(ss / K + eps) * g).to(dt), mask=k_ok)

    return norm_parts_kernel


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
           gamma: torch.Tensor | None, who: str = "decode GEMV", max_k: int | None = MAX_K) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{who} needs x [M, K] and w [N, K], got x {list(x.shape)}, w {list(w.shape)}")
    if not 0 <= x.shape[0] <= MAX_M or (max_k is not None and x.shape[1] > max_k):
        raise ValueError(f"{who} takes at most {MAX_M} rows{'' if max_k is None else f' and K <= {max_k}'}, got x "
                         f"{list(x.shape)}")
    allowed = _CUDA_DTYPES if x.is_cuda else _CPU_DTYPES
    others = [t for t in (w, bias, residual, gamma) if t is not None]
    if x.dtype not in allowed or any(t.dtype != x.dtype or t.device != x.device for t in others):
        raise ValueError(f"{who} needs every tensor on {x.device} in one dtype among "
                         f"{[str(d) for d in allowed]}, got x {x.dtype} and {[str(t.dtype) for t in others]}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{who} needs rows of x and w contiguous")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"{who} bias must be [{w.shape[0]}], got {list(bias.shape)}")
    check_norm_inputs(who, x, gamma, residual)


def is_pow2(v) -> bool:
    """Whether ``v`` is a power of two as a launch knob takes it: an int (not a bool) >= 1."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and not v & (v - 1)


def check_operands(who: str, x: torch.Tensor, w: torch.Tensor) -> None:
    """Raise ValueError (naming ``who``) unless ``x`` ``[M, K]`` and ``w`` ``[N, K]`` share a device and a dtype the
    decode kernels take there (bf16/fp16 on CUDA; float32 too on the CPU, through Triton's interpreter) and their
    rows are contiguous. The shapes are the caller's to check."""
    if x.device != w.device:
        raise ValueError(f"{who} needs x and w on one device, got {x.device} and {w.device}")
    allowed = _CUDA_DTYPES if x.is_cuda else _CPU_DTYPES
    if x.dtype not in allowed or w.dtype != x.dtype:
        raise ValueError(f"{who} needs x and w of one dtype among {[str(d) for d in allowed]} on "
                         f"{x.device.type}, got {x.dtype} and {w.dtype}")
    if (x.shape[1] > 1 and (x.stride(1) != 1 or w.stride(1) != 1)) or x.stride(0) < 0 or w.stride(0) < 0:
        raise ValueError(f"{who} needs rows of x and w contiguous, got strides {x.stride()} and {w.stride()}")


def check_norm_inputs(who: str, x: torch.Tensor, gamma: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    """The norm folded into a projection (:func:`norm_gemv`, :func:`~epdserve.models.gate_up_silu.norm_gate_up_silu`)
    takes a norm weight ``[K]`` and a residual ``[M, K]`` with contiguous rows, both in ``x``'s dtype and on its
    device (either may be None where the caller has none).

    Raises:
        ValueError: naming ``who`` and the input that is not so.
    """
    for name, t, shape in (("norm weight", gamma, (x.shape[1],)), ("residual", residual, tuple(x.shape))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{who} {name} must be {list(shape)} {x.dtype} on {x.device}, got {list(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if residual is not None and residual.shape[1] > 1 and residual.stride(1) != 1:
        raise ValueError(f"{who} needs residual rows contiguous, got strides {residual.stride()}")


def _launch(x, w, bias, residual, gamma, eps, block_n, num_warps, dtype, normed=False):
    (M, K), N, S = x.shape[-2:], w.shape[0], x.shape[0] if x.dim() == 3 else 1
    y = torch.empty(M, N, dtype=dtype, device=x.device)
    r_out = torch.empty(M, K, dtype=dtype, device=x.device) if residual is not None else None
    n_out = torch.empty(M, K, dtype=dtype, device=x.device) if normed else None
    if M == 0 or N == 0:
        return y, r_out, n_out
    pdl = supports_pdl(x.device)
    _kernel()[0][(-(-N // block_n),)](
        x, S, residual if residual is not None else x, r_out if r_out is not None else x,
        n_out if n_out is not None else x, gamma if gamma is not None else x, w, bias if bias is not None else x, y,
        M, N, K, float(eps), x.stride(-2), x.stride(0) if S > 1 else 0,
        residual.stride(0) if residual is not None else 0, w.stride(0), y.stride(0), BM=MAX_M, BN=block_n,
        BK=max(16, 1 << (K - 1).bit_length()), NORM=gamma is not None, RESID=residual is not None, NORMED=normed,
        BIAS=bias is not None, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    return y, r_out, n_out


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = BLOCK_N,
         num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``M <= MAX_M`` rows, the weights loaded before the PDL wait (module docstring).

    Args:
        x: ``[M, K]``, rows contiguous; bf16/fp16 on CUDA (float32 too on the CPU's interpreter).
        w: ``[N, K]``, rows contiguous, ``x``'s dtype and device. bias: ``[N]`` or None.
        block_n, num_warps: launch options (:data:`BLOCK_N`, :data:`NUM_WARPS`).

    Returns:
        ``[M, N]`` in ``x``'s dtype, accumulated in float32.

    Raises:
        ValueError: more than ``MAX_M`` rows, K over ``MAX_K``, mismatched shapes, dtypes or devices, rows that are
            not contiguous.
    """
    _check(x, w, bias, None, None)
    return _launch(x, w, bias, None, None, 0.0, block_n, num_warps, x.dtype)[0]


def norm_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None, block_n: int = BLOCK_N,
              num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) @ w.T (+ bias), x + residual)`` in one launch (``residual`` None: ``x`` alone is
    normed and returned as the residual), with flashinfer's ``fused_add_rmsnorm`` arithmetic (module docstring).

    Args:
        x: ``[M, K]`` hidden states (the previous block's output), rows contiguous; or that output as
            :func:`down_parts`' float32 partial products ``[S, M, K]``, summed and rounded to ``residual``'s dtype
            first.
        w, bias, block_n, num_warps: as for :func:`gemv`.
        gamma: ``[K]`` RMSNorm weight; eps: its epsilon.
        residual: ``[M, K]`` residual stream, or None (the first block; ``x`` then not in parts).

    Returns:
        ``(y [M, N], residual [M, K])``, both in the activation dtype; the residual is a new tensor (or ``x``).

    Raises:
        ValueError: as :func:`gemv`, a norm weight or residual of the wrong shape, parts without a residual.
    """
    dtype = norm_input_dtype(x, w, bias, residual, gamma)
    y, r_out, _ = _launch(x, w, bias, residual, gamma, eps, block_n, num_warps, dtype)
    return y, (x if residual is None else r_out)


def norm_gemv_normed(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`norm_gemv` (no bias) that also returns the normed rows it projected: ``(y [M, N], residual [M, K],
    normed [M, K])``, for a block whose norm feeds two consumers (an MoE router's GEMV and its experts). Same
    arguments and errors as :func:`norm_gemv`."""
    dtype = norm_input_dtype(x, w, None, residual, gamma)
    y, r_out, n_out = _launch(x, w, None, residual, gamma, eps, BLOCK_N, NUM_WARPS, dtype, normed=True)
    return y, (x if residual is None else r_out), n_out


def norm_input_dtype(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                     gamma: torch.Tensor | None) -> torch.dtype:
    """Check the inputs of a norm folded into a projection (:func:`norm_gemv`, :func:`norm_gemv_normed`,
    :func:`~epdserve.models.decode_qkv.norm_qkv_rope`): ``x`` ``[M, K]``, or split-K parts ``[S, M, K]`` float32 with a
    residual; return the activation dtype.

    Raises:
        ValueError: as :func:`norm_gemv`.
    """
    if x.dim() == 3:
        if residual is None or x.dtype != torch.float32 or x.shape[1:] != residual.shape or x.stride(-1) != 1:
            raise ValueError(f"norm_gemv takes parts [S, M, K] float32 with a residual [M, K], got x {list(x.shape)} "
                             f"{x.dtype}, residual {None if residual is None else list(residual.shape)}")
        _check(residual, w, bias, None, gamma)
        return residual.dtype
    _check(x, w, bias, residual, gamma)
    return x.dtype


def down_parts(x: torch.Tensor, w: torch.Tensor, block_n: int = SPLIT_BN, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``x @ w.T`` as split-K float32 partial products (module docstring): ``[S, M, N]``, ``S = cdiv(K,
    SPLIT_K)``; their sum is the product. For a block's last projection at one row, whose parts the next block's
    :func:`norm_gemv` sums (others: :func:`merge_parts`).

    Args:
        x: ``[M, K]``, ``M <= MAX_M``, any K; w: ``[N, K]``; rows contiguous, one dtype (as :func:`gemv`).

    Raises:
        ValueError: as :func:`gemv` (K unbounded here).
    """
    _check(x, w, None, None, None, who="down_parts", max_k=None)
    (M, K), N = x.shape, w.shape[0]
    parts = torch.empty(max(1, -(-K // SPLIT_K)), M, N, dtype=torch.float32, device=x.device)
    if M and N and K:
        pdl = supports_pdl(x.device)
        _kernel()[1][(-(-N // block_n), parts.shape[0])](
            x, w, parts, M, N, K, x.stride(0), w.stride(0), BM=MAX_M, BN=block_n, BK=SPLIT_K, PDL=pdl,
            num_warps=num_warps, launch_pdl=pdl)
    else:
        parts.zero_()
    return parts


def merge_parts(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's output as one ``[M, K]`` tensor of ``dtype``: :func:`down_parts`' ``[S, M, K]`` summed and rounded
    once; a 2-D ``x`` unchanged."""
    return x.sum(0).to(dtype) if x.dim() == 3 else x


def norm_parts(x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float,
               residual_out: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rmsnorm(sum(x) + residual)`` of split-K float32 parts ``x`` ``[S, M, K]`` (:func:`down_parts`',
    :func:`~epdserve.models.parts_gemm.gemm_parts`'): one launch for what :func:`merge_parts` and flashinfer's
    ``fused_add_rmsnorm`` do in three (the parts' sum, its cast, the add + RMSNorm; 8.6 us of a decode step on an
    H200), with their arithmetic (the sum rounded once to ``residual``'s dtype, then :func:`norm_gemv`'s add +
    RMSNorm over the unrounded float32 ``round(sum) + residual``). One program per row, any number of rows: the
    model's last norm at one row, and (``residual_out``) the add + RMSNorm after the o and down projections at
    decode batches of several rows (issue 44), where the new residual is read again.

    Args:
        x: ``[S, M, K]`` float32, contiguous. residual: ``[M, K]``, contiguous. gamma: ``[K]`` norm weight,
            residual's dtype; eps: its epsilon.
        residual_out: also store the new residual ``round(sum(x)) + residual``, rounded to ``residual``'s dtype
            (the value the norm is computed from, as :func:`norm_gemv` stores it), into a new tensor.

    Returns:
        ``normed`` ``[M, K]`` in ``residual``'s dtype; with ``residual_out``, ``(normed, new_residual)``, both
        ``[M, K]`` in ``residual``'s dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit.
    """
    if (x.dim() != 3 or x.dtype != torch.float32 or x.shape[1:] != residual.shape or not x.is_contiguous()
            or not residual.is_contiguous() or x.device != residual.device):
        raise ValueError(f"norm_parts needs parts [S, M, K] float32 and a residual [M, K] on one device, both "
                         f"contiguous, got {list(x.shape)} {x.dtype}, {list(residual.shape)} {residual.dtype}")
    check_norm_inputs("norm_parts", residual, gamma, None)
    (M, K), dtype = residual.shape, residual.dtype
    if dtype not in (_CUDA_DTYPES if x.is_cuda else _CPU_DTYPES):
        raise ValueError(f"norm_parts takes a residual in {_CUDA_DTYPES if x.is_cuda else _CPU_DTYPES}, got {dtype}")
    y = torch.empty(M, K, dtype=dtype, device=x.device)
    r_out = torch.empty(M, K, dtype=dtype, device=x.device) if residual_out else None
    if M:
        pdl = supports_pdl(x.device)
        _kernel()[2][(M,)](x, x.shape[0], x.stride(0), residual, gamma, y, r_out if residual_out else y, K,
                           float(eps), BK=max(16, 1 << (K - 1).bit_length()), R_OUT=bool(residual_out), PDL=pdl,
                           num_warps=NUM_WARPS, launch_pdl=pdl)
    return (y, r_out) if residual_out else y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gemv` where it :func:`fits`, ``F.linear`` otherwise. Same shapes and result as ``F.linear``."""
    return gemv(x, w, bias) if fits(x, w) else F.linear(x, w, bias)
