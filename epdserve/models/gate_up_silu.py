"""The MLP's gate_up projection and SiLU-and-mul in one Triton kernel, for decode batches (M <= 64).

Why: a decode step of Qwen2.5-VL-3B (hidden 2048, intermediate I = 11008, bf16) runs per layer ``gate_up =
F.linear(x, W_gate_up)`` (cuBLAS) and then flashinfer's ``silu_and_mul(gate_up)``. On an H200
(benchmarks/decode_gemms.py, one weight per layer in a CUDA graph) the projection at M = 1 took 24.87 us in cuBLAS
(3.63 TB/s) and 23.32 us (3.87 TB/s) in the bench's Triton skinny GEMM (one program per 64 output columns over the
whole K); at M = 32, 26.83 against 24.84 us; at M = 128 cuBLAS won (29.2 against 40.4 us), hence M <= 64 here.
The SiLU-and-mul kernel costs another 2.6 us per layer, 94 us per step of 36 layers, and writes then reads the
``[M, 2I]`` activation. Here each program computes ``BLOCK_N`` gate columns and the same ``BLOCK_N`` up columns
(two float32 accumulators over the whole K, no split-K) and writes ``silu(gate) * up`` directly: one kernel and
one activation round trip fewer per layer. (Fusing SiLU into the *down* projection's loads instead measured 10x
slower than the two kernels: that candidate was removed from the bench.)

Arithmetic and rounding, exactly the unfused path's up to the GEMM's float32 summation order: ``g = x @ W[:I].T``
and ``u = x @ W[I:].T`` accumulate in float32 and are each rounded to ``x``'s dtype, as cuBLAS rounds its output;
then, as flashinfer's ``act_and_mul`` does with the bf16 gate and up it loads, ``silu(g) * u`` is computed in
float32 with ``silu(g) = g / (1 + exp(-g))`` and rounded once to ``x``'s dtype. So the result equals
cuBLAS-then-``silu_and_mul`` except where the two summation orders put ``g`` or ``u`` on different sides of a
rounding boundary (one ulp of the activation dtype apart).

Measured on an H200 (benchmarks/decode_gemms.py, 2026-11-29, no flashinfer there): the fused kernel took 23.3 us at
M = 1, 25.6 at M = 32 and 25.9 at M = 64 (its best of :data:`CONFIGS` at each), the cuBLAS projection alone 24.6,
25.1 and 26.8 us; with flashinfer's 2.6 us SiLU-and-mul the unfused path is ~27-29 us.

At one row (K <= :data:`GEMV_MAX_K`) a second kernel runs instead, a GEMV in the form of
:mod:`epdserve.models.decode_gemv`: each program holds :data:`GEMV_BN` gate and as many up rows over the whole K in
registers, loaded before its PDL wait. Why: in the 3B preset's decode step at one row on an H200 the ``tl.dot``
kernel took 29.2 us of the critical path per layer for 90 MB (3.1 TB/s; docs/performance.md, seventeenth
session), the largest share of the step: it can load only its first K step before the wait, and its 344 programs
are 2.6 waves on 132 multiprocessors, the last one mostly idle; the down projection's GEMV in that form moved 45 MB
at 3.7 TB/s in the same step. Its sums are tree reductions over K (another float32 order; the same roundings).

Shapes and dtypes: ``x [M, K]``, ``M <= 64``; ``w [2I, K]`` with the gate rows ``[0, I)`` then the up rows
``[I, 2I)`` (the model's fused ``gate_up_proj`` weight); output ``[M, I]``. bf16/fp16 on CUDA (float32 too on the
CPU, through Triton's interpreter, for the tests). One launch, grid ``cdiv(I, block_n)``; CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch

from epdserve.device import supports_pdl
from epdserve.models import decode_gemv

# (block_n, block_k, num_warps, num_stages) to benchmark on Hopper for M 1..64. Each program streams 2 * block_n
# weight rows: block_n 32 gives 344 programs for I = 11008 (2.6 per SM of 132), 128 gives 86. A stage holds two
# [block_n, block_k] weight tiles and [BM, block_k] of x; every entry fits the SM's shared memory at M = 64. On an
# H200 the fastest were 32/128/4/3 at M = 1, 64/128/4/3 at M = 32 and 32/64/4/4 at M = 64 (times in the module
# docstring); block_k 256 and 128 x 128 tiles were slower at every M (26-39 us) and are left out.
CONFIGS: list[tuple[int, int, int, int]] = [
    (32, 64, 4, 4),
    (32, 64, 4, 6),
    (32, 128, 4, 3),
    (64, 64, 4, 4),
    (64, 64, 4, 6),
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (128, 64, 4, 4),
]

MAX_M = 64  # above it cuBLAS is faster (see the module docstring): the caller falls back to it
# One row with K up to decode_gemv's MAX_K: the GEMV kernel (module docstring) on decode_gemv's tile and warps, its
# BLOCK_N rows being GEMV_BN gate and GEMV_BN up rows over the whole K (32 KB of bf16 weights at K = 2048).
GEMV_MAX_K = decode_gemv.MAX_K
GEMV_BN, GEMV_WARPS = decode_gemv.BLOCK_N // 2, decode_gemv.NUM_WARPS

# The fastest entry of CONFIGS per batch-size range, measured on an H200 with flashinfer's SiLU-and-mul as the
# baseline (benchmarks/results/h200-2026-11-29-decode-s9/gemms.json): (M at most, config).
BEST: list[tuple[int, tuple[int, int, int, int]]] = [(16, (32, 128, 4, 3)), (32, (64, 128, 4, 3)),
                                                      (MAX_M, (32, 64, 4, 4))]


def config_for(m: int) -> tuple[int, int, int, int]:
    """``(block_n, block_k, num_warps, num_stages)`` for ``m`` rows (``m <= MAX_M``), from :data:`BEST`.

    Raises:
        ValueError: ``m > MAX_M``.
    """
    for top, cfg in BEST:
        if m <= top:
            return cfg
    raise ValueError(f"gate_up_silu takes at most {MAX_M} rows, got {m}")
# (dtypes: decode_gemv.check_operands; float32 only on the interpreter, as tl.dot would take it as tf32 on CUDA)


# The kernel, in order: weight offsets in int64 (2I * K of a large MLP would not fit int32). The first K step is
# peeled: its weight tiles are loaded before the PDL wait, so under PDL they stream in while the kernel before this
# one (the add + RMSNorm making x) finishes; weights are never written. With NORM, each row's 1 / RMS over the whole
# K (at most NM = 4 rows of BKN elements, from L2; reduced with tl.sum's own combine function, as tl.sum itself does
# not run on the CPU interpreter), then each input tile is rmsnorm(x (+ r)) rounded to x's dtype (flashinfer's
# fused_add_rmsnorm arithmetic) and program 0 stores the sum as the new residual; that load is written out twice,
# peeled and in the loop, as the interpreter cannot call a nested @triton.jit helper. At the end, the unfused path's
# roundings: cuBLAS rounds gate_up to the activation dtype and flashinfer loads it back to float32, so rounding here
# too keeps the two paths equal up to the summation order, not one rounding apart.
@functools.cache
def _kernel():
    """The jitted ``(gate_up_silu_kernel, gate_up_silu_gemv)``; Triton imported on first use."""
    import triton
    import triton.language as tl

    return _tiled_kernel(triton, tl), _gemv_kernel(triton, tl)


def _tiled_kernel(triton, tl):
    @triton.jit
    def gate_up_silu_kernel(x, w, y, M, I, K, x_stride, w_stride, y_stride, r, r_out, gamma, eps, r_stride,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                            PDL: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr, NM: tl.constexpr,
                            BKN: tl.constexpr):
        rows = tl.arange(0, BM)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok, col_ok = rows < M, cols < I
        gate_ptrs = w + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
        up_ptrs = w + (cols[:, None] + I).to(tl.int64) * w_stride + ks[None, :]
        k_ok = ks < K
        w_ok = col_ok[:, None] & k_ok[None, :]
        bg = tl.load(gate_ptrs, mask=w_ok, other=0.0)
        bu = tl.load(up_ptrs, mask=w_ok, other=0.0)
        if PDL:  # x is the previous kernel's output (epdserve.device.supports_pdl)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rstd = tl.full((BM,), 0.0, tl.float32)
        if NORM:
            kn = tl.arange(0, BKN)
            for m in tl.static_range(NM):
                if m < M:
                    s = tl.load(x + m * x_stride + kn, mask=kn < K, other=0.0).to(tl.float32)
                    if RESID:
                        s += tl.load(r + m * r_stride + kn, mask=kn < K, other=0.0).to(tl.float32)
                    ss = tl.reduce(s * s, 0, tl.standard._sum_combine)
                    rstd = tl.where(rows == m, tl.rsqrt(ss / K + eps), rstd)
        write = tl.program_id(0) == 0
        ok = row_ok[:, None] & k_ok[None, :]
        a = tl.load(x + rows[:, None] * x_stride + ks[None, :], mask=ok, other=0.0)
        if NORM:
            s = a.to(tl.float32)
            if RESID:
                s += tl.load(r + rows[:, None] * r_stride + ks[None, :], mask=ok, other=0.0).to(tl.float32)
                if write:
                    tl.store(r_out + rows[:, None] * K + ks[None, :], s.to(a.dtype), mask=ok)
            gk = tl.load(gamma + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (s * rstd[:, None] * gk[None, :]).to(a.dtype)
        zero = tl.full((BM, BN), 0.0, tl.float32)
        if IEEE:  # float32 inputs (interpreter tests): no tf32 rounding of the operands
            gate = tl.dot(a, tl.trans(bg), zero, input_precision="ieee")
            up = tl.dot(a, tl.trans(bu), zero, input_precision="ieee")
        else:
            gate = tl.dot(a, tl.trans(bg), zero)
            up = tl.dot(a, tl.trans(bu), zero)
        for k0 in range(BK, K, BK):
            k_ok = (k0 + ks) < K  # K's tail: masked lanes load zeros, which add nothing to either sum
            ok = row_ok[:, None] & k_ok[None, :]
            a = tl.load(x + rows[:, None] * x_stride + (k0 + ks)[None, :], mask=ok, other=0.0)
            if NORM:
                s = a.to(tl.float32)
                if RESID:
                    s += tl.load(r + rows[:, None] * r_stride + (k0 + ks)[None, :], mask=ok, other=0.0).to(tl.float32)
                    if write:
                        tl.store(r_out + rows[:, None] * K + (k0 + ks)[None, :], s.to(a.dtype), mask=ok)
                gk = tl.load(gamma + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = (s * rstd[:, None] * gk[None, :]).to(a.dtype)
            w_ok = col_ok[:, None] & k_ok[None, :]
            bg = tl.load(gate_ptrs + k0, mask=w_ok, other=0.0)
            bu = tl.load(up_ptrs + k0, mask=w_ok, other=0.0)
            if IEEE:
                gate = tl.dot(a, tl.trans(bg), gate, input_precision="ieee")
                up = tl.dot(a, tl.trans(bu), up, input_precision="ieee")
            else:
                gate = tl.dot(a, tl.trans(bg), gate)
                up = tl.dot(a, tl.trans(bu), up)
        dt = y.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        u = up.to(dt).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u  # flashinfer's silu: val / (1.0f + __expf(-val))
        tl.store(y + rows[:, None] * y_stride + cols[None, :], out.to(dt), mask=row_ok[:, None] & col_ok[None, :])

    return gate_up_silu_kernel


def _gemv_kernel(triton, tl):
    @triton.jit
    def gate_up_silu_gemv(x, w, y, I, K, w_stride, r, r_out, gamma, eps, BN: tl.constexpr, BK: tl.constexpr,
                          PDL: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr):
        # One row: BN gate and BN up rows over the whole K in registers, loaded before the wait (with the norm
        # weight); then the row (normed: its RMS over the whole K, recomputed by every program), two reductions, SiLU
        pid = tl.program_id(0)
        cols = pid * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        col_ok, k_ok = cols < I, ks < K
        ok = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(w + cols[:, None].to(tl.int64) * w_stride + ks[None, :], mask=ok, other=0.0)
        wu = tl.load(w + (cols[:, None] + I).to(tl.int64) * w_stride + ks[None, :], mask=ok, other=0.0)
        g = tl.full((BK,), 0.0, tl.float32)
        if NORM:
            g = tl.load(gamma + ks, mask=k_ok, other=0.0).to(tl.float32)
        if PDL:  # x (and the residual) are the previous kernel's output (epdserve.device.supports_pdl)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dt = y.dtype.element_ty
        v = tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)
        if RESID:
            v += tl.load(r + ks, mask=k_ok, other=0.0).to(tl.float32)
            if pid == 0:
                tl.store(r_out + ks, v.to(dt), mask=k_ok)
        if NORM:  # flashinfer's order: s * rsqrt(mean(s^2) + eps) * gamma over the unrounded sum, then rounded
            ss = tl.reduce(v * v, 0, tl.standard._sum_combine)
            v = (v * tl.rsqrt(ss / K + eps) * g).to(dt).to(tl.float32)
        gate = tl.reduce(wg.to(tl.float32) * v[None, :], 1, tl.standard._sum_combine).to(dt).to(tl.float32)
        up = tl.reduce(wu.to(tl.float32) * v[None, :], 1, tl.standard._sum_combine).to(dt).to(tl.float32)
        tl.store(y + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(dt), mask=col_ok)

    return gate_up_silu_gemv


def _check(x: torch.Tensor, w: torch.Tensor, block_n, block_k, num_warps, num_stages) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.shape[0] % 2:
        raise ValueError(f"gate_up_silu needs x [M, K] and w [2I, K] (gate rows then up rows), got x "
                         f"{list(x.shape)}, w {list(w.shape)}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"gate_up_silu is for decode batches of M <= {MAX_M} rows (use cuBLAS and silu_and_mul "
                         f"above), got M = {x.shape[0]}")
    decode_gemv.check_operands("gate_up_silu", x, w)
    if not (decode_gemv.is_pow2(block_n) and decode_gemv.is_pow2(block_k) and block_n >= 16 and block_k >= 16):
        raise ValueError(f"gate_up_silu needs power-of-two block_n and block_k >= 16 (tl.dot's minimum), got "
                         f"{block_n} and {block_k}")
    if not decode_gemv.is_pow2(num_warps) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"gate_up_silu needs a power-of-two num_warps and an int num_stages >= 1, got "
                         f"{num_warps!r} and {num_stages!r}")


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                 num_stages: int = 3) -> torch.Tensor:
    """``silu(x @ w[:I].T) * (x @ w[I:].T)`` in one launch, each product rounded to ``x``'s dtype before the SiLU
    and the product (as cuBLAS then flashinfer's ``silu_and_mul`` compute it; see the module docstring).

    Args:
        x: ``[M, K]`` activations, ``M <= 64``, rows contiguous (any row stride); bf16/fp16 on CUDA, also float32
            on the CPU (Triton's interpreter).
        w: ``[2I, K]`` fused gate_up weight (gate rows ``[0, I)``, up rows ``[I, 2I)``), rows contiguous, ``x``'s
            dtype and device.
        block_n: intermediate columns per program (a power of two >= 16); I need not be a multiple of it.
        block_k: K per loop step (a power of two >= 16); K need not be a multiple of it.
        num_warps, num_stages: Triton launch options (see :data:`CONFIGS`); 3 stages were the fastest with the
            default 64 x 128 tiles on an H200 (23.9 and 25.6 us at M = 1 and 32, against 26.2 and 30.4 with 4).
            The tile and launch options do not apply at one row with K <= :data:`GEMV_MAX_K` (the GEMV kernel).

    Returns:
        ``[M, I]`` in ``x``'s dtype, contiguous.

    Raises:
        ValueError: ``M > 64`` (the caller falls back to cuBLAS), wrong dims, an odd ``w.shape[0]``, mismatched K,
            devices or dtypes, a dtype other than bf16/fp16 on CUDA, rows that are not contiguous, or bad tile or
            launch options.
    """
    _check(x, w, block_n, block_k, num_warps, num_stages)
    return _launch(x, w, None, None, 0.0, block_n, block_k, num_warps, num_stages)[0]


NORM_MAX_M = 4  # rows that norm_gate_up_silu takes: its per-row RMS pass is unrolled over them


def norm_gate_up_silu(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None, block_n: int = 64, block_k: int = 128,
                      num_warps: int = 4, num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gate_up_silu` of ``rmsnorm(x + residual)`` in one launch, for ``M <= NORM_MAX_M`` rows: the add +
    RMSNorm kernel before the MLP folded into it (issue 44). Every program computes each row's RMS itself (the row
    is a few KB in L2); program 0 also stores the new residual. The norm is flashinfer's ``fused_add_rmsnorm``
    arithmetic: the sum in float32 (stored rounded), ``s * rsqrt(mean(s^2) + eps) * gamma`` over the unrounded sum,
    rounded to ``x``'s dtype before the projection (see :mod:`epdserve.models.decode_gemv`).

    Args:
        x: ``[M, K]`` (the attention block's output), ``M <= NORM_MAX_M``, ``K <= 4096``.
        w, block_n, block_k, num_warps, num_stages: as for :func:`gate_up_silu`.
        gamma: ``[K]`` RMSNorm weight (``x``'s dtype); eps: its epsilon.
        residual: ``[M, K]`` residual stream, or None (``x`` alone is normed and returned as the residual).

    Returns:
        ``(silu(gate) * up [M, I], x + residual [M, K])`` in ``x``'s dtype; the residual is a new tensor (or ``x``).

    Raises:
        ValueError: as :func:`gate_up_silu`, more than ``NORM_MAX_M`` rows or K over 4096, a norm weight or
            residual of another shape, dtype or device, a residual whose rows are not contiguous.
    """
    _check(x, w, block_n, block_k, num_warps, num_stages)
    if x.shape[0] > NORM_MAX_M or x.shape[1] > 4096:
        raise ValueError(f"norm_gate_up_silu takes at most {NORM_MAX_M} rows and K <= 4096, got {list(x.shape)}")
    decode_gemv.check_norm_inputs("norm_gate_up_silu", x, gamma, residual)
    y, r_out = _launch(x, w, gamma, residual, eps, block_n, block_k, num_warps, num_stages)
    return y, (x if residual is None else r_out)


def _launch(x, w, gamma, residual, eps, block_n, block_k, num_warps, num_stages):
    (M, K), inter = x.shape, w.shape[0] // 2
    y = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else None
    if M == 0 or inter == 0:
        return y, r_out
    if K == 0:  # no launch for an empty sum: silu(0) * 0
        return y.zero_(), r_out
    pdl = supports_pdl(x.device)
    if M == 1 and K <= GEMV_MAX_K:
        _kernel()[1][(-(-inter // GEMV_BN),)](
            x, w, y, inter, K, w.stride(0), residual if residual is not None else x,
            r_out if r_out is not None else x, gamma if gamma is not None else x, float(eps), BN=GEMV_BN,
            BK=max(16, 1 << (K - 1).bit_length()), PDL=pdl, NORM=gamma is not None, RESID=residual is not None,
            num_warps=GEMV_WARPS, launch_pdl=pdl)
        return y, r_out
    block_m = max(16, 1 << (M - 1).bit_length())  # tl.dot's minimum tile is 16 rows; masked rows load zeros
    # the RMS pass's width; without a norm one value, so the plain kernel compiles once for every K
    norm_k = max(16, 1 << (K - 1).bit_length()) if gamma is not None else 16
    _kernel()[0][(-(-inter // block_n),)](
        x, w, y, M, inter, K, x.stride(0), w.stride(0), y.stride(0), residual if residual is not None else x,
        r_out if r_out is not None else x, gamma if gamma is not None else x, float(eps),
        residual.stride(0) if residual is not None else 0, BM=block_m, BN=block_n, BK=block_k,
        IEEE=x.dtype == torch.float32, PDL=pdl, NORM=gamma is not None, RESID=residual is not None,
        NM=NORM_MAX_M, BKN=norm_k, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
    return y, r_out
