"""NeoX-style RoPE applied in place to q and k with a per-token cos|sin table: one Triton launch per layer.

This is the arithmetic of flashinfer's ``apply_rope_with_cos_sin_cache_inplace(arange(T), q, k, head_dim, table,
is_neox=True)``, which the models used before: per head, ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` over
the two halves of ``head_dim`` in float32, rounded to the activation dtype. flashinfer's version is a JIT module
whose largest file takes ~27 s to compile (docs/performance.md, "2026-11-28, sixth session"), the longest wait of a
fresh server's start-up; this kernel compiles in about a second. M-RoPE needs nothing more: the table already holds
each token's angles (:func:`~epdserve.models.qwen2_vl_lm.mrope_cos_sin_table`). CUDA only: Triton is imported on
first use.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_inplace(q, k, table, q_stride, k_stride, table_stride,
                     HQ: tl.constexpr, HKV: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr):
        # One program per token: every q and k head of the row at once, [H_PAD, HALF] per half.
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, H_PAD)[:, None]
        offs = tl.arange(0, HALF)[None, :]
        is_q = h < HQ
        row = tl.where(is_q, q + t * q_stride + h * (2 * HALF), k + t * k_stride + (h - HQ) * (2 * HALF))
        mask = (h < HQ + HKV) & (offs < HALF)  # the second term is always true: it gives the mask the block's shape
        x1 = tl.load(row + offs, mask=mask).to(tl.float32)
        x2 = tl.load(row + HALF + offs, mask=mask).to(tl.float32)
        cos = tl.load(table + t * table_stride + offs)
        sin = tl.load(table + t * table_stride + HALF + offs)
        dt = q.dtype.element_ty
        tl.store(row + offs, (x1 * cos - x2 * sin).to(dt), mask=mask)
        tl.store(row + HALF + offs, (x2 * cos + x1 * sin).to(dt), mask=mask)

    return rope_inplace


def rope_inplace(q: torch.Tensor, k: torch.Tensor, head_dim: int, table: torch.Tensor) -> None:
    """Rotate ``q`` and ``k`` in place (NeoX halves) by each token's angles.

    Args:
        q: ``[T, num_q_heads * head_dim]`` bf16/fp16 on CUDA; heads contiguous within a row, rows at any stride
            (a column slice of the fused qkv projection's output is fine).
        k: ``[T, num_kv_heads * head_dim]``, same dtype, layout rules as ``q``.
        head_dim: a power of two.
        table: ``[T, head_dim]`` float32, cos of the token's angles in the first half and sin in the second (see
            :class:`~epdserve.models.qwen2_vl_lm._Rope`), rows contiguous.

    Raises:
        ValueError: a head_dim that is not a power of two, rows of q or k that are not contiguous or not a whole
            number of heads, dtypes that differ, or a table of the wrong shape or dtype.
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
    if T:
        _kernel()[(T,)](q, k, table, q.stride(0), k.stride(0), table.stride(0), HQ=hq, HKV=hkv,
                        H_PAD=1 << (hq + hkv - 1).bit_length(), HALF=head_dim // 2)
