"""NeoX-style RoPE applied in place to q and k with a per-token cos|sin table: one Triton launch per layer.

This is the arithmetic of flashinfer's ``apply_rope_with_cos_sin_cache_inplace(arange(T), q, k, head_dim, table,
is_neox=True)``, which the models used before: per head, ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` over
the two halves of ``head_dim`` in float32, rounded to the activation dtype. flashinfer's version is a JIT module
whose largest file takes ~27 s to compile (docs/performance.md, "2026-11-28, sixth session"), the longest wait of a
fresh server's start-up; this kernel compiles in about a second. M-RoPE needs nothing more: the table already holds
each token's angles (:func:`~epdserve.models.qwen2_vl_lm.mrope_cos_sin_table`). CUDA only: Triton is imported on
first use.

Given a :class:`~epdserve.attention.base.KVWrite`, the same launch also stores the rotated K and the V heads at each
token's KV slot, so the attention backend makes no indexed copy of its own: a decode step of the 3B preset spent
3.2 us per layer in that copy against 1.4 us in this kernel (H200, docs/performance.md, "2026-11-29").
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
    def rope_inplace(q, k, v, table, kc, vc, slots, q_stride, k_stride, v_stride, table_stride, kc_stride,
                     vc_stride, HQ: tl.constexpr, HKV: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr,
                     WRITE_KV: tl.constexpr):
        # One program per token: every q, k (and with WRITE_KV v) head of the row at once, [H_PAD, HALF] per half.
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, H_PAD)[:, None]
        offs = tl.arange(0, HALF)[None, :]
        is_q, is_k = h < HQ, (h >= HQ) & (h < HQ + HKV)
        row = tl.where(is_q, q + t * q_stride + h * (2 * HALF), k + t * k_stride + (h - HQ) * (2 * HALF))
        if WRITE_KV:
            row = tl.where(h < HQ + HKV, row, v + t * v_stride + (h - HQ - HKV) * (2 * HALF))
            heads = HQ + 2 * HKV
        else:
            heads = HQ + HKV
        mask = (h < heads) & (offs < HALF)  # the second term is always true: it gives the mask the block's shape
        x1 = tl.load(row + offs, mask=mask).to(tl.float32)
        x2 = tl.load(row + HALF + offs, mask=mask).to(tl.float32)
        cos = tl.load(table + t * table_stride + offs)
        sin = tl.load(table + t * table_stride + HALF + offs)
        dt = q.dtype.element_ty
        rotate = h < HQ + HKV  # v heads pass through unrotated
        y1 = tl.where(rotate, x1 * cos - x2 * sin, x1).to(dt)
        y2 = tl.where(rotate, x2 * cos + x1 * sin, x2).to(dt)
        in_place = rotate & mask
        tl.store(row + offs, y1, mask=in_place)
        tl.store(row + HALF + offs, y2, mask=in_place)
        if WRITE_KV:
            slot = tl.load(slots + t).to(tl.int64)
            dst = tl.where(is_k, kc + slot * kc_stride + (h - HQ) * (2 * HALF),
                           vc + slot * vc_stride + (h - HQ - HKV) * (2 * HALF))
            to_cache = (h >= HQ) & mask
            tl.store(dst + offs, y1, mask=to_cache)
            tl.store(dst + HALF + offs, y2, mask=to_cache)

    return rope_inplace


def rope_inplace(q: torch.Tensor, k: torch.Tensor, head_dim: int, table: torch.Tensor, v: torch.Tensor | None = None,
                 kv_write: KVWrite | None = None) -> None:
    """Rotate ``q`` and ``k`` in place (NeoX halves) by each token's angles; with ``kv_write``, also store the rotated
    ``k`` and ``v`` at each token's KV slot.

    Args:
        q: ``[T, num_q_heads * head_dim]`` bf16/fp16 on CUDA; heads contiguous within a row, rows at any stride
            (a column slice of the fused qkv projection's output is fine).
        k: ``[T, num_kv_heads * head_dim]``, same dtype, layout rules as ``q``.
        head_dim: a power of two.
        table: ``[T, head_dim]`` float32, cos of the token's angles in the first half and sin in the second (see
            :class:`~epdserve.models.qwen2_vl_lm._Rope`), rows contiguous.
        v: ``[T, num_kv_heads * head_dim]``, layout rules as ``k``; needed with ``kv_write``, read only.
        kv_write: the layer's K and V slot views (``[slots, num_kv_heads, head_dim]``, ``q``'s dtype, rows of
            contiguous heads) and the int64 ``[T]`` slot of each token.

    Raises:
        ValueError: a head_dim that is not a power of two, rows of q, k or v that are not contiguous or not a whole
            number of heads, dtypes that differ, a table of the wrong shape or dtype, or a ``kv_write`` whose
            slot views or slots do not fit (or without ``v``).
    """
    T = q.shape[0]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_inplace needs a power-of-two head_dim, got {head_dim}")
    if q.stride(1) != 1 or k.stride(1) != 1 or q.shape[1] % head_dim or k.shape[1] % head_dim or k.shape[0] != T:
        raise ValueError(f"rope_inplace needs q and k rows of whole heads, contiguous within the row; got q "
                         f"{list(q.shape)} stride {q.stride()}, k {list(k.shape)} stride {k.stride()}")
    if q.dtype != k.dtype:
        raise ValueError(f"rope_inplace needs q and k of one dtype, got {q.dtype} and {k.dtype}")
    if table.dtype != torch.float32 or tuple(table.shape) != (T, head_dim) or table.stride(1) != 1:
        raise ValueError(f"rope_inplace needs a float32 [{T}, {head_dim}] table, got {table.dtype} "
                         f"{list(table.shape)}")
    hq, hkv = q.shape[1] // head_dim, k.shape[1] // head_dim
    if kv_write is not None:
        if v is None or v.shape != k.shape or v.stride(1) != 1 or v.dtype != k.dtype:
            raise ValueError(f"rope_inplace with kv_write needs v shaped and typed as k {list(k.shape)} {k.dtype}")
        check_kv_write(kv_write, T, hkv, head_dim, k.dtype)
        kc, vc, slots = kv_write.k_slots, kv_write.v_slots, kv_write.slots
        heads, strides = hq + 2 * hkv, (v.stride(0), table.stride(0), kc.stride(0), vc.stride(0))
    else:
        v, kc, vc, slots = k, k, k, table  # unused pointers: WRITE_KV is off
        heads, strides = hq + hkv, (0, table.stride(0), 0, 0)
    if T:
        _kernel()[(T,)](q, k, v, table, kc, vc, slots, q.stride(0), k.stride(0), *strides, HQ=hq, HKV=hkv,
                        H_PAD=1 << (heads - 1).bit_length(), HALF=head_dim // 2, WRITE_KV=kv_write is not None)
