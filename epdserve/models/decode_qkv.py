"""A decoder layer's front at one decode row in one launch: add + RMSNorm, the qkv projection, NeoX RoPE on q and k,
and the new K and V stored at the token's KV slot.

Why (issue 44): at one row the 3B preset's layer ran this as :func:`~epdserve.models.decode_gemv.norm_gemv` and then
:func:`~epdserve.models.rope_inplace.rope_inplace` (1.4-1.9 us, launched without PDL), two launches and the gap
between them for ~30 KB of activations. Here each program owns 4 column pairs ``(j, j + D/2)`` of one head, the two
halves that RoPE mixes, so the rotation happens in registers: program ``p`` takes head ``p // (D / 8)`` and columns
``4 * (p % (D / 8)) + [0, 4)`` of each half, its weight rows loaded before the PDL wait as in
:mod:`~epdserve.models.decode_gemv`.

Arithmetic, as the two kernels compute it: the norm as :func:`~epdserve.models.decode_gemv.norm_gemv` (flashinfer's
``fused_add_rmsnorm`` order; the input may be the previous block's split-K parts), each projected column accumulated
in float32 and rounded to the activation dtype, then RoPE in float32 over those rounded values (``x1 * cos - x2 *
sin``, ``x2 * cos + x1 * sin``) and rounded again; V columns pass through. So q, the cached K and V, and the new
residual equal the two-kernel path's up to the summation order of the projection.

Shapes and dtypes: ``x`` ``[1, K]`` (or split-K parts ``[S, 1, K]`` float32), ``K <= MAX_K``; ``w`` ``[(hq + 2 hkv)
* D, K]``; ``table`` ``[1, D]`` float32 (cos | sin, :class:`~epdserve.models.qwen2_vl_lm._Rope`); K/V slot views
``[slots, hkv, D]``. bf16/fp16 on CUDA, float32 too on the CPU's Triton interpreter (the tests). CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch

from epdserve.attention.base import KVWrite, check_kv_write
from epdserve.device import supports_pdl
from epdserve.models import decode_gemv

PAIRS = 4  # column pairs per program: 8 weight rows, as decode_gemv's BLOCK_N


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_qkv_rope_kernel(x, S: tl.constexpr, x_part_stride, r, r_out, gamma, w, bias, y, table, kc, vc, slots,
                             K, eps, w_stride, kc_stride, vc_stride, HQ: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr, BK: tl.constexpr,
                             RESID: tl.constexpr, BIAS: tl.constexpr, WRITE_KV: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        head = pid // (HALF // P)
        offs = (pid % (HALF // P)) * P + tl.arange(0, P)  # this program's columns within each half of the head
        cols = head * D + offs
        ks = tl.arange(0, BK)
        k_ok = ks < K
        w1 = tl.load(w + cols[:, None].to(tl.int64) * w_stride + ks[None, :], mask=k_ok[None, :], other=0.0)
        w2 = tl.load(w + (cols + HALF)[:, None].to(tl.int64) * w_stride + ks[None, :], mask=k_ok[None, :],
                     other=0.0)
        b1 = tl.full((P,), 0.0, tl.float32)
        b2 = tl.full((P,), 0.0, tl.float32)
        if BIAS:
            b1 = tl.load(bias + cols).to(tl.float32)
            b2 = tl.load(bias + cols + HALF).to(tl.float32)
        g = tl.load(gamma + ks, mask=k_ok, other=0.0).to(tl.float32)
        cos = tl.load(table + offs)
        sin = tl.load(table + HALF + offs)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dt = y.dtype.element_ty
        v = tl.full((BK,), 0.0, tl.float32)
        # the previous block's output, maybe in split-K parts: summed (all loads in flight at once), rounded once
        for p in tl.static_range(S):
            v += tl.load(x + p * x_part_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
        v = v.to(dt).to(tl.float32)
        if RESID:
            v += tl.load(r + ks, mask=k_ok, other=0.0).to(tl.float32)
            if pid == 0:
                tl.store(r_out + ks, v.to(dt), mask=k_ok)
        ss = tl.reduce(v * v, 0, tl.standard._sum_combine)
        v = (v * tl.rsqrt(ss / K + eps) * g).to(dt).to(tl.float32)
        a1 = (tl.reduce(w1.to(tl.float32) * v[None, :], 1, tl.standard._sum_combine) + b1).to(dt).to(tl.float32)
        a2 = (tl.reduce(w2.to(tl.float32) * v[None, :], 1, tl.standard._sum_combine) + b2).to(dt).to(tl.float32)
        rotate = head < HQ + HKV  # V heads pass through
        y1 = tl.where(rotate, a1 * cos - a2 * sin, a1).to(dt)
        y2 = tl.where(rotate, a2 * cos + a1 * sin, a2).to(dt)
        tl.store(y + cols, y1)
        tl.store(y + cols + HALF, y2)
        if WRITE_KV:
            if head >= HQ:
                slot = tl.load(slots).to(tl.int64)
                if head < HQ + HKV:
                    dst = kc + slot * kc_stride + (head - HQ) * D
                else:
                    dst = vc + slot * vc_stride + (head - HQ - HKV) * D
                tl.store(dst + offs, y1)
                tl.store(dst + HALF + offs, y2)

    return norm_qkv_rope_kernel


def fits(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`norm_qkv_rope` takes this layer's input ``x`` (one row, or its split-K parts) and qkv weight
    ``w`` on this device: CUDA, one row, ``K <= MAX_K``, a power-of-two ``head_dim`` of at least ``2 * PAIRS``."""
    row = x if x.dim() == 2 else x[0]
    return (w.is_cuda and row.shape[0] == 1 and w.shape[1] <= decode_gemv.MAX_K and head_dim >= 2 * PAIRS
            and head_dim & (head_dim - 1) == 0 and w.dtype in (torch.bfloat16, torch.float16)
            and w.shape[0] % head_dim == 0)


def norm_qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, head_dim: int, num_q_heads: int, num_kv_heads: int,
                  table: torch.Tensor, kv_write: KVWrite | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qkv, residual)`` for one decode row: ``qkv`` ``[1, (hq + 2 hkv) * D]`` is ``rmsnorm(x + residual) @ w.T
    (+ bias)`` with q and k rotated by ``table``'s angles (module docstring); with ``kv_write`` the rotated K and the V
    heads are also stored at ``kv_write.slots[0]``.

    Args:
        x: ``[1, K]`` the previous block's output, or its split-K parts ``[S, 1, K]`` float32
            (:func:`~epdserve.models.decode_gemv.down_parts`, which need ``residual``).
        w, bias, gamma, eps, residual: as for :func:`~epdserve.models.decode_gemv.norm_gemv`.
        head_dim, num_q_heads, num_kv_heads: ``w``'s rows are ``num_q_heads`` q heads, then the K heads, then the V
            heads, of ``head_dim`` each.
        table: ``[1, head_dim]`` float32, cos of the token's angles then sin.
        kv_write: the layer's K and V slot views and the token's slot, or None (the caller stores K and V).

    Returns:
        ``(qkv [1, N], residual [1, K])`` in the activation dtype (the residual is ``x`` where ``residual`` is None).

    Raises:
        ValueError: what :func:`~epdserve.models.decode_gemv.norm_gemv` raises, more than one row, a head layout
            that does not match ``w``, a table of the wrong shape, or a ``kv_write`` that does not fit.
    """
    D, hq, hkv = head_dim, num_q_heads, num_kv_heads
    if w.shape[0] != (hq + 2 * hkv) * D or D < 2 * PAIRS or D & (D - 1):
        raise ValueError(f"norm_qkv_rope needs w of ({hq} + 2 * {hkv}) heads of a power-of-two head_dim >= "
                         f"{2 * PAIRS}, got w {list(w.shape)}, head_dim {D}")
    parts = x.dim() == 3
    row = x[0] if parts else x
    if row.shape[0] != 1:
        raise ValueError(f"norm_qkv_rope takes one row, got x {list(x.shape)}")
    dtype = decode_gemv.norm_input_dtype(x, w, bias, residual, gamma)
    if table.dtype != torch.float32 or tuple(table.shape) != (1, D) or table.stride(1) != 1:
        raise ValueError(f"norm_qkv_rope needs a float32 [1, {D}] table, got {table.dtype} {list(table.shape)}")
    if kv_write is not None:
        check_kv_write(kv_write, 1, hkv, D, dtype)
        kc, vc, slots = kv_write.k_slots, kv_write.v_slots, kv_write.slots
        strides = (kc.stride(0), vc.stride(0))
    else:
        kc, vc, slots, strides = w, w, table, (0, 0)  # unused: WRITE_KV is off
    K = w.shape[1]
    y = torch.empty(1, w.shape[0], dtype=dtype, device=w.device)
    r_out = torch.empty(1, K, dtype=dtype, device=w.device) if residual is not None else None
    pdl = supports_pdl(w.device)
    _kernel()[(w.shape[0] // (2 * PAIRS),)](
        x, x.shape[0] if parts else 1, x.stride(0) if parts else 0, residual if residual is not None else x,
        r_out if r_out is not None else x, gamma, w, bias if bias is not None else w, y, table, kc, vc, slots, K,
        float(eps), w.stride(0), *strides, HQ=hq, HKV=hkv, D=D, HALF=D // 2, P=PAIRS,
        BK=max(16, 1 << (K - 1).bit_length()), RESID=residual is not None, BIAS=bias is not None,
        WRITE_KV=kv_write is not None, PDL=pdl,
        num_warps=decode_gemv.NUM_WARPS, launch_pdl=pdl)
    return y, (x if residual is None else r_out)
