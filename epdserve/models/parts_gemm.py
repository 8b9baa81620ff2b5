"""Decode-sized projections (2 to 128 rows) as one split-K Triton GEMM that loads its first weight tiles before it
waits for the kernel before it, and leaves its float32 partial products for the next kernel (an add + RMSNorm) to
sum: no reduce kernel of its own.

Why (issue 44): in the 3B preset's decode step at 32 and 128 rows on an H200 (hidden 2048, MLP width 11008, bf16)
the o projection (``[2048, 2048]``, 8.4 MB) took 6.0-6.5 us a layer in cuBLAS against a ~2.0 us memory roofline,
and the down projection (``[2048, 11008]``, 45 MB) 15.7-19 us against ~10.7, cuBLAS's separate split-K reduce
kernel included; each is followed by flashinfer's fused add + RMSNorm (2.5 us). At one row
:mod:`epdserve.models.decode_gemv` closed that gap with a GEMV whose weights load before the PDL wait and whose
split-K parts the next norm sums; this is the same plan for several rows, with ``tl.dot`` instead of a GEMV.

Algorithm: grid ``(cdiv(N, block_n), S)`` with ``S = cdiv(K, k_split)``. Program ``(n, s)`` owns ``block_n`` output
columns over K slice ``s`` = ``[s * k_split, (s + 1) * k_split)`` (the last one cut at K). It loads the slice's first
``prefetch * block_k`` weight columns (one ``[block_n, prefetch * block_k]`` tile) *before*
``griddepcontrol.wait`` (programmatic dependent launch, PDL: :func:`epdserve.device.supports_pdl`), so under PDL
they stream in while the previous kernel (the attention, or the SiLU-and-mul) still runs; weights are never
written. Then it waits, lets the next kernel launch, loads ``x``'s rows (``block_m`` of them, rows past M masked to
zeros) and runs the rest of its slice through ``tl.dot`` in ``block_k`` steps (software-pipelined over
``num_stages``), accumulating in float32, and stores its ``[M, block_n]`` part. The parts ``[S, M, N]`` sum to
``x @ w.T``: :func:`epdserve.models.decode_gemv.norm_parts` (``residual_out=True``) sums them, rounds the sum once
to the activation dtype (as cuBLAS rounds its output), adds the residual and applies the RMSNorm in one launch,
replacing cuBLAS's reduce kernel and flashinfer's ``fused_add_rmsnorm``.

Sources: split-K GEMM (CUTLASS's "parallel split-K": partial products reduced by a second kernel, here by the
norm); PDL (CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization"; Triton's
``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents``); the weight prefetch of Hazy Research's decode megakernel
("Look Ma, No Bubbles", 2025) applied kernel by kernel; the first K tile peeled before the wait as in
:func:`epdserve.models.gate_up_silu.gate_up_silu`'s ``tl.dot`` kernel.

Measured on an H200 (3B preset, decode step GPU time at 2 / 4 / 8 / 16 / 32 / 64 / 128 rows, variants in one
process, docs/performance.md, nineteenth session): cuBLAS with flashinfer's norms 2.457 / 2.581 / 2.657 / 2.768 /
3.011 / 3.520 / 3.845 ms; o alone through here 2.415 / 2.520 / 2.547 / 2.677 / 2.892 / 3.435 / 3.826; o and down
(down in 8 parts of 128 columns over 8 warps up to 32 rows) 2.332 / 2.411 / 2.530 / 2.646 / 2.887 / 3.466 (3.378
with :data:`_TABLE`'s 64-row entry) / 3.955. So a wide K (past :data:`WIDE_K`) goes through here up to
:data:`MAX_M_WIDE` rows only: at 128 rows cuBLAS's split-K GEMM and its reduce were faster for the down projection.
The 7B preset's wider layers (hidden 3584) with these configs: 1.02x slower at 8 and 32 rows (same H200 session), so
:func:`fits` keeps to the widths measured, ``N`` and a narrow ``K`` up to :data:`MAX_N` (a K between it and
``WIDE_K``, such as the 30B-A3B's o projection, was not measured); wider layers keep cuBLAS until swept.

Shapes and dtypes: ``x`` ``[M, K]`` (``M <= MAX_M``, rows contiguous, any row stride), ``w`` ``[N, K]`` (rows
contiguous) of one dtype, bf16/fp16 on CUDA (float32 too on the CPU, through Triton's interpreter, for the tests);
parts ``[S, M, N]`` float32, contiguous. One launch, a grid fixed by the shapes: CUDA-graph safe. Callers check
:func:`fits` and fall back to cuBLAS.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from epdserve.device import supports_pdl
from epdserve.models import decode_gemv

MIN_M, MAX_M = 2, 128  # one row: decode_gemv's GEMV; past 128 rows the weights are no longer the whole cost
WIDE_K, MAX_M_WIDE = 4096, 64  # a K past WIDE_K (the MLP's down projection) fits up to MAX_M_WIDE rows (docstring)
MAX_N = 2048  # the layer widths measured (docstring): N and a narrow K up to it

_CUDA_DTYPES = (torch.bfloat16, torch.float16)  # float32 only on the interpreter (decode_gemv.check_operands)


def rows_tile(m: int) -> int:
    """The smallest row tile for ``m`` rows: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << (m - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch shape of :func:`gemm_parts`.

    block_m: rows per tile, a power of two 16..128 (at least M; :meth:`with_rows` raises it to fit). block_n:
    output columns per program, a power of two >= 16. block_k: K per ``tl.dot`` step, a power of two >= 16.
    k_split: K per part (a multiple of block_k); S = cdiv(K, k_split) parts. num_warps, num_stages: Triton's.
    prefetch: block_k tiles loaded before the PDL wait, as one tile (a power of two, ``prefetch * block_k <=
    k_split``; ``k_split // block_k``: the whole slice, as decode_gemv's GEMV loads it).
    """

    block_m: int
    block_n: int
    block_k: int
    k_split: int
    num_warps: int
    num_stages: int
    prefetch: int = 1

    @property
    def name(self) -> str:
        """``BM/BN/BK/KS/W/S``, then ``/pP`` where more than one tile loads before the wait."""
        base = f"{self.block_m}/{self.block_n}/{self.block_k}/{self.k_split}/{self.num_warps}/{self.num_stages}"
        return base + (f"/p{self.prefetch}" if self.prefetch > 1 else "")

    def with_rows(self, m: int) -> Config:
        """This config with ``block_m`` raised to :func:`rows_tile` of ``m`` where it is smaller."""
        return dataclasses.replace(self, block_m=max(self.block_m, rows_tile(m)))

    def parts(self, k: int) -> int:
        """How many parts (S) a K of ``k`` makes: ``cdiv(k, k_split)``, at least one."""
        return max(1, -(-k // self.k_split))


# Candidates for the GPU sweep (benchmarks/decode_gemms.py), at M 2..128 where each is raised to the row tile M needs
# (Config.with_rows; a block_m of 64 asks for Hopper's warp-group MMA tile even at fewer rows). Programs per
# projection on an H200's 132 SMs: o (N = K = 2048) in 512-column slices is 4 parts x 64 (block_n 32) or x 32
# (64) programs; down (K = 11008) in 2816-column slices is 4 parts (2816 = 22 x 128; the last 2560), in 1408 8
# parts. The prefetched tile is at most 32 KB a program over 4 warps, 64 KB over 8 (256 bytes, 64 registers, a thread).
CONFIGS: list[Config] = [
    # o-sized K slices
    Config(16, 32, 128, 512, 4, 3, prefetch=4),  # the whole 32 KB slice before the wait, as decode_gemv's GEMV
    Config(16, 32, 128, 1024, 4, 3, prefetch=2),
    Config(16, 64, 128, 512, 4, 3, prefetch=2),
    Config(16, 64, 128, 512, 8, 3, prefetch=4),
    Config(16, 32, 64, 1024, 4, 4),
    Config(16, 64, 64, 1024, 4, 4),
    Config(64, 64, 128, 512, 4, 3, prefetch=2),
    # down-sized K slices
    Config(16, 32, 128, 2816, 4, 4, prefetch=2),
    Config(16, 64, 128, 2816, 4, 4),
    Config(16, 64, 64, 2816, 4, 4),
    Config(16, 64, 128, 1408, 4, 4, prefetch=2),
    Config(16, 128, 128, 1408, 8, 3),
    Config(16, 32, 256, 2816, 4, 3),
    Config(64, 64, 128, 2816, 4, 4, prefetch=2),
]

# config_for's table: (M at most, K at most, block_n, block_k, parts, num_warps, num_stages, prefetch), k_split = K /
# parts rounded up to block_k. More rows: wider column blocks at up to 64 rows (x's tile grows with M, the weights'
# does not), then narrower ones over fewer parts at 128 rows, where each part's [M, N] float32 store and the norm's
# load of it are 1 MB. A wide K up to 32 rows: 8 parts of 128 columns over 8 warps, the fastest of five in the 3B's
# step on an H200 (module docstring); its 128-row entry serves direct calls only (fits excludes it).
_TABLE: list[tuple[int, int, int, int, int, int, int, int]] = [
    (16, 4096, 32, 128, 4, 4, 3, 4),
    (64, 4096, 64, 128, 4, 4, 3, 2),
    (MAX_M, 4096, 32, 64, 2, 4, 4, 1),
    (32, 1 << 62, 128, 128, 8, 8, 3, 1),
    (64, 1 << 62, 64, 128, 4, 4, 4, 1),
    (MAX_M, 1 << 62, 64, 64, 4, 4, 4, 1),
]


def config_for(m: int, n: int, k: int) -> Config:
    """The :class:`Config` for ``m`` rows of ``[n, k]`` weights: the first entry of ``_TABLE`` whose M and K bounds
    hold (chosen by the module docstring's sweep on the 3B's widths), ``block_m`` the row tile of ``m``,
    ``prefetch`` lowered where a short slice has fewer tiles. ``n`` is not used yet.

    Raises:
        ValueError: ``m`` outside ``1..MAX_M``.
    """
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemm_parts takes 1 to {MAX_M} rows, got {m}")
    _, _, bn, bk, parts, warps, stages, pre = next(e for e in _TABLE if m <= e[0] and k <= e[1])
    per_part = -(-k // parts)
    k_split = max(bk, -(-per_part // bk) * bk)
    while pre > 1 and pre * bk > k_split:
        pre //= 2
    return Config(rows_tile(m), bn, bk, k_split, warps, stages, pre)


def covers(m: int, n: int, k: int) -> bool:
    """Whether ``m`` rows of ``[n, k]`` weights go through here in a decode step (the module docstring's
    measurements): ``MIN_M <= m <= MAX_M``, ``n <= MAX_N``, and ``k <= MAX_N``, or ``k > WIDE_K`` at up to
    ``MAX_M_WIDE`` rows."""
    return MIN_M <= m <= MAX_M and n <= MAX_N and (k <= MAX_N or k > WIDE_K and m <= MAX_M_WIDE)


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemm_parts` is meant for ``x`` ``[M, K]`` and ``w`` ``[N, K]``: CUDA, bf16/fp16 of one dtype
    and device, rows contiguous, and :func:`covers` ``(M, N, K)``."""
    return (x.is_cuda and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and covers(x.shape[0], w.shape[0], x.shape[1]) and x.dtype in _CUDA_DTYPES and w.dtype == x.dtype
            and w.device == x.device and x.stride(1) == 1 and w.stride(1) == 1)


@functools.cache
def _kernel():
    """The jitted ``parts_gemm_kernel``; Triton imported on first use."""
    import triton
    import triton.language as tl

    return _parts_kernel(triton, tl)


# Offsets into w in int64 (N * K of a wide projection passes int32). The peeled tile and the loop's tiles are written
# out twice (the interpreter cannot call a nested @triton.jit helper); the loop's bounds are constexprs, so its trip
# count is known and Triton pipelines it over num_stages. K's tail (the last slice only): masked lanes load zeros.
def _parts_kernel(triton, tl):
    @triton.jit
    def parts_gemm_kernel(x, w, parts, M, N, K, x_stride, w_stride, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, KS: tl.constexpr, PRE: tl.constexpr, IEEE: tl.constexpr,
                          PDL: tl.constexpr):
        s = tl.program_id(1)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        rows = tl.arange(0, BM)
        row_ok, col_ok = rows < M, cols < N
        w_rows = w + cols[:, None].to(tl.int64) * w_stride
        k0 = s * KS
        kp = k0 + tl.arange(0, PRE * BK)
        b = tl.load(w_rows + kp[None, :], mask=col_ok[:, None] & (kp < K)[None, :], other=0.0)
        if PDL:  # x is the previous kernel's output (epdserve.device.supports_pdl)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(x + rows[:, None] * x_stride + kp[None, :], mask=row_ok[:, None] & (kp < K)[None, :], other=0.0)
        zero = tl.full((BM, BN), 0.0, tl.float32)
        if IEEE:  # the CPU interpreter, whose tl.dot would multiply bf16's raw bits: float32 operands (bf16 and
            # fp16 exactly so), no tf32 rounding; the products and sums of the tensor cores' bf16 dot
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), zero, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), zero)
        ks = tl.arange(0, BK)
        for kk in range(PRE * BK, KS, BK):
            kj = k0 + kk + ks
            k_ok = kj < K
            ai = tl.load(x + rows[:, None] * x_stride + kj[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bi = tl.load(w_rows + kj[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(ai.to(tl.float32), tl.trans(bi.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(ai, tl.trans(bi), acc)
        out = parts + (s * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])

    return parts_gemm_kernel


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_parts needs x [M, K] and w [N, K], got x {list(x.shape)}, w {list(w.shape)}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"gemm_parts takes 1 to {MAX_M} rows (decode batches), got M = {x.shape[0]}")
    decode_gemv.check_operands("gemm_parts", x, w)


def _check_config(cfg: Config, m: int) -> None:
    if not isinstance(cfg, Config):
        raise ValueError(f"gemm_parts takes a parts_gemm.Config, got {cfg!r}")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if not (decode_gemv.is_pow2(bm) and 16 <= bm <= 128 and bm >= m):
        raise ValueError(f"gemm_parts needs block_m a power of two in 16..128 and at least M = {m}, got {bm}")
    if not (decode_gemv.is_pow2(bn) and decode_gemv.is_pow2(bk) and bn >= 16 and bk >= 16):
        raise ValueError(f"gemm_parts needs power-of-two block_n and block_k >= 16 (tl.dot's minimum), got {bn} "
                         f"and {bk}")
    if not (isinstance(cfg.k_split, int) and cfg.k_split >= bk and cfg.k_split % bk == 0):
        raise ValueError(f"gemm_parts needs k_split a positive multiple of block_k = {bk}, got {cfg.k_split!r}")
    if not (decode_gemv.is_pow2(cfg.prefetch) and cfg.prefetch * bk <= cfg.k_split):
        raise ValueError(f"gemm_parts needs prefetch a power of two with prefetch * block_k <= k_split, got "
                         f"{cfg.prefetch!r} x {bk} against {cfg.k_split}")
    if not (decode_gemv.is_pow2(cfg.num_warps) and isinstance(cfg.num_stages, int) and cfg.num_stages >= 1):
        raise ValueError(f"gemm_parts needs a power-of-two num_warps and an int num_stages >= 1, got "
                         f"{cfg.num_warps!r} and {cfg.num_stages!r}")


def gemm_parts(x: torch.Tensor, w: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """``x @ w.T`` as split-K float32 partial products ``[S, M, N]`` whose sum over S is the product (module
    docstring), the first weight tiles of each program loaded before the PDL wait. For a projection whose output
    goes to :func:`epdserve.models.decode_gemv.norm_parts` (the add + RMSNorm sums the parts).

    Args:
        x: ``[M, K]`` activations, ``1 <= M <= MAX_M``, rows contiguous (any row stride); bf16/fp16 on CUDA, also
            float32 on the CPU (Triton's interpreter).
        w: ``[N, K]`` weight, rows contiguous, ``x``'s dtype and device.
        config: launch shape; None: :func:`config_for`. Its ``block_m`` must be at least M.

    Returns:
        ``[S, M, N]`` float32, contiguous, ``S = cdiv(K, config.k_split)`` (one part of zeros where K is 0),
        accumulated in float32.

    Raises:
        ValueError: M outside ``1..MAX_M``, wrong dims or mismatched K, devices or dtypes, a dtype other than
            bf16/fp16 on CUDA, rows that are not contiguous, or a config that is not valid for M rows.
    """
    _check(x, w)
    (M, K), N = x.shape, w.shape[0]
    cfg = config_for(M, N, K) if config is None else config
    _check_config(cfg, M)
    parts = torch.empty(cfg.parts(K), M, N, dtype=torch.float32, device=x.device)
    if N == 0:
        return parts
    if K == 0:  # no launch for an empty sum
        return parts.zero_()
    pdl = supports_pdl(x.device)
    _kernel()[(-(-N // cfg.block_n), parts.shape[0])](
        x, w, parts, M, N, K, x.stride(0), w.stride(0), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        KS=cfg.k_split, PRE=cfg.prefetch, IEEE=not x.is_cuda, PDL=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl)
    return parts
