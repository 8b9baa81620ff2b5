"""Choosing the attention backend: flashinfer's paged kernels on CUDA where they exist for the head size, else
PyTorch SDPA."""

from __future__ import annotations

import logging

import torch

from epdserve.attention.base import AttentionBackend
from epdserve.kvcache.kv_pool import KVPool

logger = logging.getLogger(__name__)

# Head sizes flashinfer's prebuilt/JIT prefill and decode kernels are known to cover.
_FLASHINFER_HEAD_DIMS = (64, 128, 256)


def make_backend(name: str, kv_pool: KVPool, num_qo_heads: int) -> AttentionBackend:
    """Build the backend ``name``: ``"sdpa"``, ``"flashinfer"`` or ``"auto"`` (flashinfer on CUDA when it is
    installed, the head size is 64, 128 or 256 and the KV is 16-bit, else SDPA).

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
    if name == "auto" and on_cuda and kv_pool.dtype not in (torch.bfloat16, torch.float16):
        name = "sdpa"  # flashinfer's attention kernels are 16-bit only (float32: KeyError in its JIT)
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
