"""The paged KV cache storage of one model replica (allocation is the schedulers' job, not this class's)."""

from __future__ import annotations

import os
import weakref

import torch


class KVPool:
    """K and V of every layer, paged: ``k_cache(l)``/``v_cache(l)`` are ``[num_pages, page_size, H, D]``.

    That is flashinfer's NHD paged layout (docs.flashinfer.ai, "KV-Cache Layout"). A slot is
    ``page * page_size + offset_in_page``. All layers live in one ``[L, 2, num_pages, page_size, H, D]`` buffer
    so a KV transfer gathers/scatters every layer with one index op. The buffer is zero-filled because the SDPA
    backend reads whole pages: garbage (NaN) in unused slots would leak through a zero attention weight.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, shm_path: str = ""):
        """Allocate ``num_layers * 2 * num_pages * page_size * num_kv_heads * head_dim`` elements on ``device``.

        On the CPU, a ``shm_path`` puts the buffer in that new /dev/shm file (removed again when the pool is
        garbage-collected or the process exits normally) so another process can map it.

        Raises:
            ValueError: a non-positive size.
            torch.OutOfMemoryError: the buffer does not fit.
        """
        if min(num_layers, num_pages, page_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("KVPool sizes must be positive")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        self.shm_path = shm_path if torch.device(device).type == "cpu" else ""
        if self.shm_path:
            numel = num_layers * 2 * num_pages * page_size * num_kv_heads * head_dim
            # A new file reads as zeros, like torch.zeros below.
            self.buffer = torch.from_file(self.shm_path, shared=True, size=numel, dtype=dtype).view(shape)
            weakref.finalize(self, os.unlink, self.shm_path)
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self._flat = self.buffer.view(num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)

    @staticmethod
    def bytes_per_page(*, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        """Bytes one page takes across all layers, K and V."""
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, H, D]`` view of layer ``layer``'s K pages."""
        return self.buffer[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, H, D]`` view of layer ``layer``'s V pages."""
        return self.buffer[layer, 1]

    def slot_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``layer`` as ``[num_pages * page_size, H, D]`` views indexed by slot."""
        return self._flat[layer, 0], self._flat[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new ``k``, ``v`` (``[n, H, D]``, cast to the pool dtype) of layer ``layer`` at ``slots`` (``[n]``
        int64 on the pool device).

        When ``v`` follows ``k`` in each row of one buffer (the K and V column blocks of a fused qkv projection's
        output, as the models pass them), both are written by one indexed copy instead of two: a decode step
        launches one kernel fewer per layer."""
        if (kv := _adjacent_kv(k, v, self.dtype)) is not None:
            self._flat[layer].transpose(0, 1)[slots] = kv
            return
        self._flat[layer, 0, slots] = k.to(self.dtype)
        self._flat[layer, 1, slots] = v.to(self.dtype)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Gather ``[num_layers, 2, n, H, D]`` (K at index 0) at ``slots`` ``[n]`` (a new tensor, pool device)."""
        return self._flat[:, :, slots.to(self.device)]

    def write_all(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter a received transfer ``kv`` ``[num_layers, 2, n, H, D]`` into ``slots`` ``[n]`` of every layer.

        Raises:
            ValueError: ``kv`` has the wrong shape.
        """
        expected = (self.num_layers, 2, slots.numel(), self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv shape {tuple(kv.shape)} != expected {expected}")
        self._flat[:, :, slots.to(self.device)] = kv.to(self.device, self.dtype)


def _adjacent_kv(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``[n, 2, H, D]`` view over ``k`` and ``v`` (``[n, H, D]`` each) when ``v``'s row starts where ``k``'s ends in
    the same storage with the same strides and ``dtype`` (nothing to cast), else None."""
    if k.dtype != dtype or v.dtype != dtype or k.shape != v.shape or k.dim() != 3 or k.stride() != v.stride():
        return None
    n, h, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d or v.device != k.device:
        return None
    if v.data_ptr() != k.data_ptr() + h * d * k.element_size():
        return None
    if v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    return k.as_strided((n, 2, h, d), (k.stride(0), h * d, d, 1))
