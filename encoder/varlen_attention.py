"""Packed (varlen) attention for transformers' Qwen-VL vision towers on CUDA, from PyTorch's own FlashAttention-2.

Why: with transformers' ``sdpa`` implementation the Qwen2-VL / Qwen2.5-VL vision attention splits the packed
patches at ``cu_seqlens`` and calls SDPA once per window (``cu_seqlens.tolist()`` is a host sync per layer): a
448x448 image in Qwen2.5-VL's windowed tower is 16 windows x 32 layers = 512 small attention calls, ~70 ms per
image on an H100 (docs/performance.md). Given an attention implementation whose name contains "flash",
transformers calls it once per layer with ``cu_seq_lens_q``/``cu_seq_lens_k`` instead (its flash-attention path).
We register one under :data:`NAME` that runs ``torch.ops.aten._flash_attention_forward``, the FlashAttention-2
varlen kernel PyTorch ships for CUDA (used by its nested-tensor SDPA), so no extra package is needed. Non-causal,
no dropout: the vision tower's attention. CPU keeps transformers' ``sdpa`` (bit-exact parity with HF).
"""

from __future__ import annotations

import torch

NAME = "epdserve_flash_varlen"


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                     scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                     cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                     max_length_k: int | None = None, is_causal: bool = False, **kwargs):
    """transformers attention-interface function: ``query``/``key``/``value`` ``[1, heads, T, head_dim]`` (fp16 or
    bf16, CUDA) packed by ``cu_seq_lens_q/k`` (int32 ``[N + 1]``) -> ``([1, T, heads, head_dim], None)``.

    Raises:
        ValueError: no ``cu_seq_lens_q`` (transformers calls it only on its packed flash-attention path).
    """
    if cu_seq_lens_q is None:
        raise ValueError(f"{NAME} needs packed sequences (cu_seq_lens_q)")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    if max_length_q is None:
        max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    if max_length_k is None:
        max_length_k = max_length_q if cu_seq_lens_k is None else int((cu_k[1:] - cu_k[:-1]).max())
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seq_lens_q.to(torch.int32), cu_k.to(torch.int32), max_length_q, max_length_k, dropout,
        is_causal, False, scale=scaling)[0]
    return out.unsqueeze(0), None


def register() -> str:
    """Register :func:`varlen_attention` with transformers' ``AttentionInterface`` (idempotent); returns its
    name, to pass as ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME
