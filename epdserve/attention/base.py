"""The attention backend interface the LM calls (it never knows which backend runs), and its factory."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool

logger = logging.getLogger(__name__)

# Head sizes flashinfer's prebuilt/JIT prefill and decode kernels are known to cover.
_FLASHINFER_HEAD_DIMS = (64, 128, 256)


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


def make_backend(name: str, kv_pool: KVPool, num_qo_heads: int) -> AttentionBackend:
    """Build the backend ``name``: ``"sdpa"``, ``"flashinfer"`` or ``"auto"`` (flashinfer on CUDA when it is
    installed and the head size is 64, 128 or 256, else SDPA).

    Raises:
        ValueError: unknown name, or ``"flashinfer"`` on a non-CUDA pool.
        ImportError: ``"flashinfer"`` asked for and not installed.
    """
    if name not in ("auto", "sdpa", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'sdpa' or 'flashinfer'")
    on_cuda = kv_pool.device.type == "cuda"
    if name == "flashinfer" and not on_cuda:
        raise ValueError(f"the flashinfer backend needs a CUDA device, the KV pool is on {kv_pool.device}")
    if name == "auto" and on_cuda and kv_pool.head_dim not in _FLASHINFER_HEAD_DIMS:
        name = "sdpa"  # e.g. the tiny test checkpoint (head_dim 32): flashinfer ships no kernels for it
    if name == "auto" and on_cuda:
        try:
            import flashinfer  # noqa: F401  (probe only; the backend module imports it for real)
            name = "flashinfer"
        except ImportError:
            logger.warning("flashinfer is not installed; using the slower SDPA attention backend on CUDA")
            name = "sdpa"
    if name == "flashinfer":
        from epdserve.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(kv_pool, num_qo_heads)
    from epdserve.attention.sdpa import SdpaBackend

    return SdpaBackend(kv_pool, num_qo_heads)
