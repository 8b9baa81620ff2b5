"""Choosing the attention backend: flashinfer's paged kernels on CUDA where they exist for the head size, else
PyTorch SDPA."""

from __future__ import annotations

import logging

import torch

from epdserve.attention.base import AttentionBackend
from epdserve.attention.triton_decode_plan import decode_kernel
from epdserve.kvcache.kv_pool import KVPool

logger = logging.getLogger(__name__)

# Head sizes flashinfer's prebuilt/JIT prefill and decode kernels are known to cover.
_FLASHINFER_HEAD_DIMS = (64, 128, 256)


def choose_backend(name: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """The backend ``name`` resolves to, ``"sdpa"`` or ``"flashinfer"``: ``"auto"`` is flashinfer on CUDA when it is
    installed, the head size is 64, 128 or 256 and the KV is 16-bit, else SDPA (logged when flashinfer is missing).

    Raises:
        ValueError: unknown name, or ``"flashinfer"`` on a non-CUDA device.
    """
    if name not in ("auto", "sdpa", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'sdpa' or 'flashinfer'")
    on_cuda = device.type == "cuda"
    if name == "flashinfer" and not on_cuda:
        raise ValueError(f"the flashinfer backend needs a CUDA device, the KV pool is on {device}")
    if name == "auto" and on_cuda and head_dim not in _FLASHINFER_HEAD_DIMS:
        name = "sdpa"  # e.g. the tiny test checkpoint (head_dim 32): flashinfer ships no kernels for it
    if name == "auto" and on_cuda and dtype not in (torch.bfloat16, torch.float16):
        name = "sdpa"  # flashinfer's attention kernels are 16-bit only (float32: KeyError in its JIT)
    if name == "auto" and on_cuda:
        try:
            import flashinfer  # noqa: F401  (probe only; the backend module imports it for real)
            name = "flashinfer"
        except ImportError:
            logger.warning("flashinfer is not installed; using the slower SDPA attention backend on CUDA")
            name = "sdpa"
    return "sdpa" if name == "auto" else name


def make_backend(name: str, kv_pool: KVPool, num_qo_heads: int, kernels=None, decode: str = "auto") -> AttentionBackend:
    """Build the backend ``name`` resolves to (:func:`choose_backend`) over ``kv_pool``; ``kernels``: the runner's
    :class:`~epdserve.attention.flashinfer_kernels.KernelBuild` for flashinfer (None: modules build on first use);
    ``decode``: the flashinfer backend's decode kernel (:func:`decode_kernel`); the SDPA backend ignores it.

    Raises:
        ValueError: unknown name or decode kernel, or ``"flashinfer"`` on a non-CUDA pool.
        ImportError: ``"flashinfer"`` asked for and not installed.
    """
    decode_kernel(decode, kv_pool.head_dim)  # an unknown name fails here, whichever backend runs
    name = choose_backend(name, kv_pool.device, kv_pool.head_dim, kv_pool.dtype)
    if name == "flashinfer":
        from epdserve.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(kv_pool, num_qo_heads, kernels, decode_kernel=decode)
    from epdserve.attention.sdpa import SdpaBackend

    return SdpaBackend(kv_pool, num_qo_heads)
