"""The attention backend interface the LM calls (it never knows which backend runs); :mod:`epdserve.attention.select`
picks one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool


@dataclass(frozen=True)
class KVWrite:
    """Where one layer's new K and V go in this forward: ``k_slots``/``v_slots`` ``[num_slots, Hkv, D]`` views of
    the layer's KV pages (pool dtype) and ``slots`` int64 ``[T]``, each new token's slot."""

    k_slots: torch.Tensor
    v_slots: torch.Tensor
    slots: torch.Tensor


def check_kv_write(kv_write: KVWrite, tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError unless ``kv_write`` takes ``tokens`` new tokens of ``num_kv_heads`` heads of ``head_dim`` in
    ``dtype``: slot views ``[slots, num_kv_heads, head_dim]`` with contiguous heads, int64 ``[tokens]`` slots."""
    for name, c in (("k_slots", kv_write.k_slots), ("v_slots", kv_write.v_slots)):
        if c.dim() != 3 or tuple(c.shape[1:]) != (num_kv_heads, head_dim) or c.stride(1) != head_dim \
                or c.stride(2) != 1 or c.dtype != dtype:
            raise ValueError(f"kv_write.{name} must be [slots, {num_kv_heads}, {head_dim}] {dtype} with contiguous "
                             f"heads, got {list(c.shape)} {c.dtype} stride {c.stride()}")
    if kv_write.slots.dtype != torch.int64 or tuple(kv_write.slots.shape) != (tokens,):
        raise ValueError(f"kv_write.slots must be int64 [{tokens}], got {kv_write.slots.dtype} "
                         f"{list(kv_write.slots.shape)}")


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
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_written: bool = False, early_kv: bool = False) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (RoPE applied) -> attention output ``[T, Hq, D]``.
        ``kv_written``: the caller already stored ``k``/``v`` where :meth:`kv_write` said. ``early_kv``: and the
        kernel that stored them launched its dependents early (programmatic dependent launch), so a decode kernel
        may load the older KV before waiting for it (a hint: only a backend whose kernel does that reads it)."""

    def kv_write(self, layer_id: int, dtype: torch.dtype) -> KVWrite | None:
        """Where a caller may store layer ``layer_id``'s new K/V (``dtype``) itself in this forward (a kernel it
        runs anyway, such as RoPE, writing them on the way) and then call :meth:`forward` with ``kv_written=True``;
        None: the backend writes them in :meth:`forward` (this one always, or a pool of another dtype, which needs
        a cast). Valid after :meth:`prepare`."""
        return None
