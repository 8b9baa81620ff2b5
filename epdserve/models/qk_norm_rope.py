"""Qwen3's per-head q/k RMSNorm and RoPE in one CUDA kernel (Triton), reading q and k straight out of the fused
qkv projection's output.

Unfused, a Qwen3 attention layer copies q and k out of the strided qkv output, runs flashinfer's ``rmsnorm`` on
each and then its RoPE: five launches per layer, ~30 us of a decode step's 36-layer Qwen3-VL-8B budget each
(docs/performance.md). This kernel does the same arithmetic in one launch: per (token, head) row, the RMSNorm in
float32 (``x * rsqrt(mean(x^2) + eps) * w``, flashinfer's formula) rounded to the activation dtype, then NeoX-style
rotation in float32 with the forward's cos/sin table (flashinfer's ``apply_rope_with_cos_sin_cache_inplace``
layout: ``[T, head_dim]`` float32, cos in the first half, sin in the second), rounded again. The same as the two
flashinfer kernels up to the order of the float32 sum (tests/test_qk_norm_rope.py bounds it); SGLang fuses the same
pair in its ``fused_qk_norm_rope`` kernel. CUDA only: Triton is imported on first use. Given a
:class:`~epdserve.attention.base.KVWrite`, the launch also stores K and V in the KV cache (as
:mod:`epdserve.models.rope_inplace` does), so the attention backend makes no indexed copy of its own.
"""

from __future__ import annotations

import functools

import torch

from epdserve.attention.base import KVWrite, check_kv_write


# No PDL launch (epdserve.device.supports_pdl): this kernel follows the qkv GEMM, and started early it cost the
# 3B preset's batch-32 decode step 3 % on an H200 and saved under 1 % at batch 1 (docs/performance.md, eleventh
# session).
@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope(qkv, q_out, k_out, q_w, k_w, table, kc, vc, slots, qkv_stride, table_stride, kc_stride,
                     vc_stride, eps, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, WRITE_KV: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, HALF)
        src = qkv + t.to(tl.int64) * qkv_stride + h * (2 * HALF)
        if WRITE_KV:
            slot = tl.load(slots + t).to(tl.int64)
            if h >= HQ + HKV:  # a v head: copied to its slot as it is
                dst = vc + slot * vc_stride + (h - HQ - HKV) * (2 * HALF)
                tl.store(dst + offs, tl.load(src + offs))
                tl.store(dst + HALF + offs, tl.load(src + HALF + offs))
                return
        x1 = tl.load(src + offs).to(tl.float32)
        x2 = tl.load(src + HALF + offs).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        if h < HQ:
            w, dst = q_w, q_out + (t.to(tl.int64) * HQ + h) * (2 * HALF)
        else:
            w, dst = k_w, k_out + (t.to(tl.int64) * HKV + h - HQ) * (2 * HALF)
        dt = q_out.dtype.element_ty
        y1 = (x1 * r * tl.load(w + offs).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (x2 * r * tl.load(w + HALF + offs).to(tl.float32)).to(dt).to(tl.float32)
        cos = tl.load(table + t.to(tl.int64) * table_stride + offs)
        sin = tl.load(table + t.to(tl.int64) * table_stride + HALF + offs)
        o1, o2 = (y1 * cos - y2 * sin).to(dt), (y2 * cos + y1 * sin).to(dt)
        tl.store(dst + offs, o1)
        tl.store(dst + HALF + offs, o2)
        if WRITE_KV:
            if h >= HQ:
                cache = kc + slot * kc_stride + (h - HQ) * (2 * HALF)
                tl.store(cache + offs, o1)
                tl.store(cache + HALF + offs, o2)

    return qk_norm_rope


def qk_norm_rope(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, table: torch.Tensor,
                 kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then RoPE of the q and k heads of a fused qkv projection output; with ``kv_write``, the
    same launch stores the rotated k heads and the v heads at each token's KV slot.

    Args:
        qkv: ``[T, (num_q_heads + 2 * num_kv_heads) * head_dim]`` bf16/fp16 on CUDA, rows contiguous (the
            projection's output; the v heads are read only with ``kv_write``).
        q_weight, k_weight: ``[head_dim]`` RMSNorm weights.
        eps: the RMSNorm epsilon.
        table: ``[T, head_dim]`` float32 cos|sin per token (see :class:`~epdserve.models.qwen2_vl_lm._Rope`).
        kv_write: the layer's K and V slot views (``[slots, num_kv_heads, head_dim]``, ``qkv``'s dtype, rows of
            contiguous heads) and the int64 ``[T]`` slot of each token.

    Returns:
        ``q`` ``[T, num_q_heads, head_dim]`` and ``k`` ``[T, num_kv_heads, head_dim]``, new contiguous tensors in
        ``qkv``'s dtype.

    Raises:
        ValueError: an odd ``head_dim`` or one that is not a power of two, a table of the wrong shape or dtype,
            qkv rows that are not contiguous, or a ``kv_write`` that does not fit.
    """
    T = qkv.shape[0]
    if head_dim % 2 or head_dim & (head_dim - 1) or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_rope needs a power-of-two head_dim and contiguous rows, got {head_dim}")
    if table.dtype != torch.float32 or tuple(table.shape) != (T, head_dim) or table.stride(1) != 1:
        raise ValueError(f"qk_norm_rope needs a float32 [{T}, {head_dim}] table, got {table.dtype} "
                         f"{list(table.shape)}")
    q = torch.empty((T, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((T, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    heads = num_q_heads + num_kv_heads
    if kv_write is not None:
        check_kv_write(kv_write, T, num_kv_heads, head_dim, qkv.dtype)
        kc, vc, slots, heads = kv_write.k_slots, kv_write.v_slots, kv_write.slots, heads + num_kv_heads
    else:
        kc, vc, slots = k, k, table  # unused pointers: WRITE_KV is off
    if T:
        _kernel()[(T, heads)](qkv, q, k, q_weight, k_weight, table, kc, vc, slots, qkv.stride(0), table.stride(0),
                              kc.stride(0), vc.stride(0), eps, HQ=num_q_heads, HKV=num_kv_heads, HALF=head_dim // 2,
                              WRITE_KV=kv_write is not None)
    return q, k
