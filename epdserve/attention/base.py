"""The attention backend interface the LM calls (it never knows which backend runs); :mod:`epdserve.attention.select`
picks one."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool


class AttentionBackend(ABC):
    """Paged causal attention over a :class:`KVPool`.

    Contract: :meth:`prepare` is called once per model forward with the batch; then :meth:`forward` once per
    layer. ``forward`` writes the new K/V to ``batch.out_slots`` and attends each request's new queries over its
    whole KV (cached prefix from its pages, then the new tokens): new token ``j`` of a request with ``q_len`` q and
    ``kv_len`` L sits at KV index ``L - q + j`` and sees KV indices ``0 .. L - q + j``.
    """

    uses_flashinfer = False  # flashinfer is installed and its kernels fit: fused ops and CUDA graphs apply

    def __init__(self, kv_pool: KVPool, num_qo_heads: int):
        """``num_qo_heads`` must be a multiple of the pool's KV heads (GQA)."""
        if num_qo_heads % kv_pool.num_kv_heads:
            raise ValueError(f"{num_qo_heads} query heads is not a multiple of {kv_pool.num_kv_heads} KV heads")
        self.kv_pool = kv_pool
        self.num_qo_heads = num_qo_heads
        self.scale = kv_pool.head_dim ** -0.5

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-forward metadata (KV slot lists, masks, kernel plans) from ``batch`` (tensors on the pool
        device)."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (RoPE applied) -> attention output ``[T, Hq, D]``."""
