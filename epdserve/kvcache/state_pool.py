"""Per-request recurrent state of the linear-attention (Gated DeltaNet) layers of a hybrid model (Qwen3.5).

A DeltaNet layer keeps no KV: each request carries a fixed-size state whatever its length, so the pool is a set
of slots (one per running request), not pages. Allocation lives here (unlike the KV pool's pages, which the
schedulers own) because a slot is one integer per request and must be zeroed when handed out.
"""

from __future__ import annotations

import os
import weakref

import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shm_path: str) -> torch.Tensor:
    """A zeroed tensor; on the CPU with ``shm_path``, living in that new /dev/shm file (removed with the pool), so
    another process of this machine can map it (:func:`epdserve.kvcache.kv_share.open_pool`)."""
    if not shm_path:
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(shm_path, shared=True, size=numel, dtype=dtype).view(shape)  # a new file reads as 0


class StatePool:
    """Conv and recurrent states of ``layers`` DeltaNet layers for ``num_slots`` requests, plus one scratch slot.

    Tensors (``layer`` is the index among the DeltaNet layers, not the decoder-layer id):

    - ``conv[layer]``: ``[num_slots + 1, *conv_shape]`` in ``dtype``; for Qwen3.5 ``conv_shape`` is
      ``(conv_dim, kernel)``: the last ``kernel`` inputs (before the convolution, q|k|v channels) of the causal
      conv1d, oldest first, as transformers' ``LinearAttentionLayer.update_conv_state`` keeps them.
    - ``recurrent[layer]``: ``[num_slots + 1, *recurrent_shape]`` in ``recurrent_dtype`` (default float32: the
      reference delta rule computes and returns its state in float32, as the FLA kernels keep it); for Qwen3.5
      ``(value_heads, key_dim, value_dim)``.

    Both live in one buffer each, ``conv_buffer`` ``[layers, num_slots + 1, *conv_shape]`` and ``recurrent_buffer``
    (``conv[layer]`` is a view of ``conv_buffer[layer]``), so a hand-off gathers a slot of every layer with one index
    op and another process can map them (``shm_paths``, CPU; CUDA buffers export an IPC handle).

    ``conv[layer][slot]`` / ``recurrent[layer][slot]`` are a request's. Slot ``num_slots`` (``scratch_slot``) is never
    handed out: CUDA-graph padding rows (future) and warm-up forwards write there. All slots start zeroed and
    :meth:`alloc` zeroes the slot it returns, so a request always starts from the zero state a fresh transformers
    cache has. Not thread-safe: one scheduler thread allocates.
    """

    def __init__(self, num_slots: int, layers: int, conv_shape: tuple[int, ...], recurrent_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str, recurrent_dtype: torch.dtype = torch.float32,
                 shm_paths: tuple[str, str] = ("", "")):
        """Allocate ``layers * (num_slots + 1)`` conv and recurrent states on ``device`` (on the CPU with
        ``shm_paths``, in those two new /dev/shm files: conv, recurrent).

        Raises:
            ValueError: ``num_slots`` or ``layers`` not positive.
            torch.OutOfMemoryError: the states do not fit.
        """
        if num_slots <= 0 or layers <= 0:
            raise ValueError(f"StatePool needs positive num_slots and layers, got {num_slots}, {layers}")
        self.num_slots, self.layers = num_slots, layers
        self.conv_shape, self.recurrent_shape = tuple(conv_shape), tuple(recurrent_shape)
        self.dtype, self.recurrent_dtype, self.device = dtype, recurrent_dtype, torch.device(device)
        self.scratch_slot = num_slots
        self.shm_paths = shm_paths if self.device.type == "cpu" and all(shm_paths) else ("", "")
        self.conv_buffer = _zeros((layers, num_slots + 1, *conv_shape), dtype, self.device, self.shm_paths[0])
        self.recurrent_buffer = _zeros((layers, num_slots + 1, *recurrent_shape), recurrent_dtype, self.device,
                                       self.shm_paths[1])
        for path in self.shm_paths:
            if path:
                weakref.finalize(self, os.unlink, path)
        self.conv = list(self.conv_buffer.unbind(0))
        self.recurrent = list(self.recurrent_buffer.unbind(0))
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Slots :meth:`alloc` can still hand out."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots handed out and not freed."""
        return len(self._used)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one request's state takes across all layers (conv + recurrent)."""
        conv = torch.Size(self.conv_shape).numel() * torch.empty((), dtype=self.dtype).element_size()
        rec = torch.Size(self.recurrent_shape).numel() * torch.empty((), dtype=self.recurrent_dtype).element_size()
        return self.layers * (conv + rec)

    def alloc(self, zero: bool = True) -> int:
        """A free slot, its states zeroed (a fresh request starts from zeros) unless ``zero`` is False (a slot that
        is written whole before it is read: a transfer engine's target).

        Raises:
            RuntimeError: every slot is in use.
        """
        if not self._free:
            raise RuntimeError(f"StatePool: all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        for conv, rec in zip(self.conv, self.recurrent) if zero else ():
            conv[slot].zero_()
            rec[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool (its states are zeroed again at the next :meth:`alloc`).

        Raises:
            ValueError: ``slot`` is not allocated (a double free, the scratch slot, or out of range).
        """
        if slot not in self._used:
            raise ValueError(f"StatePool: slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
