"""Handing a tensor to another process on the same machine through GPU memory (CUDA IPC) instead of its bytes.

The encoder pushes embeddings to every TP rank of a prefill server. Through host memory that is a device-to-host
copy, the bytes through a TCP socket, and a pageable host-to-device copy: ~100 ms for the 57.7 MB of an 8-second
Qwen3-VL-8B clip on an H100 host (docs/performance.md). When both ends share a machine, the encoder instead puts
each embedding in its own GPU memory and sends a :class:`~epdserve.wire.messages.SharedTensor` per receiver: the
fields of torch's ``UntypedStorage._share_cuda_()`` (the call ``torch.multiprocessing`` makes, here without
pickle), which carry a CUDA IPC memory handle, an IPC event the receiver's stream waits on before reading, and a
reference counter in shared memory. The receiver copies the tensor into its own memory on arrival
(:func:`take`) and drops the mapping, which decrements the counter; the sender's memory, released meanwhile, sits
in torch's "limbo" until every receiver's counter is back to zero, and :meth:`DeviceSharer.share` frees what is
collectable (``torch.cuda.ipc_collect``) before it shares more. A receiver that never takes a handle (its process
died with the message queued) keeps that tensor in the sender's limbo until the sender exits.
"""

from __future__ import annotations

import logging

import torch

from epdserve.wire.codec import FLOAT_DTYPE_NAMES
from epdserve.wire.messages import ImageEmbeddings, SharedTensor

log = logging.getLogger(__name__)


class DeviceSharer:
    """The sending side on one CUDA device: copies tensors into fresh GPU memory and names them for receivers.

    Args:
        device: this process's CUDA device.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None

    def share(self, tensors: list[torch.Tensor], receivers: int) -> list[list[SharedTensor]]:
        """Put ``tensors`` (any device, any layout) in this device's memory, one contiguous storage each, and
        name each for ``receivers`` processes: ``out[r][i]`` is tensor ``i`` for receiver ``r``, which must
        :func:`take` it exactly once. Blocks until the copies are done (call it from a worker thread); the copies
        run on a stream of their own, so they never wait for the tower's queued work.

        Raises:
            RuntimeError: CUDA errors (out of memory, IPC not supported).
        """
        torch.cuda.ipc_collect()  # frees earlier shares that every receiver has taken
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # A fresh tensor per item: the handle names its whole storage, from byte 0.
            local = [torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t, non_blocking=True)
                     for t in tensors]
            self._stream.synchronize()
            return [[_name(t) for t in local] for _ in range(receivers)]


def _name(t: torch.Tensor) -> SharedTensor:
    # Each call puts the storage behind a new reference counter, released by the one receiver it is meant for.
    ipc = list(t.untyped_storage()._share_cuda_())
    return SharedTensor(cuda_ipc=ipc, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))


def take(shared: SharedTensor, device: torch.device) -> torch.Tensor:
    """Copy a tensor another process shared with this one into a new tensor on ``device`` and release the
    sender's memory. Runs on ``device``'s current stream, after the sender's copy (its IPC event), and waits for
    the copy to finish before it returns (the release lets the sender reuse the memory).

    Returns:
        A contiguous ``shared.shape`` tensor of ``shared.dtype`` on ``device`` that this process owns.

    Raises:
        ValueError: an unknown dtype or a handle without 8 fields.
        RuntimeError: the mapping fails (another machine, another IPC namespace, the sender exited).
    """
    if shared.dtype not in FLOAT_DTYPE_NAMES or len(shared.cuda_ipc) != 8:
        raise ValueError(f"not a shared {shared.dtype!r} tensor handle")
    dtype, src = getattr(torch, shared.dtype), torch.device("cuda", int(shared.cuda_ipc[0]))
    out = torch.empty(shared.shape, dtype=dtype, device=device)
    with torch.cuda.device(src):
        storage = torch.UntypedStorage._new_shared_cuda(*shared.cuda_ipc)
        numel = out.numel()
        view = torch.empty(0, dtype=dtype, device=src).set_(storage, 0, (numel,), (1,))
        out.view(-1).copy_(view)
        del view, storage  # its deleter waits for the copy, then releases the sender's counter
    return out


def take_all(values: list, device: torch.device) -> list[torch.Tensor]:
    """``values`` with every :class:`SharedTensor` taken (see :func:`take`) and tensors left as they are. Every
    shared one is taken even when one fails, so no sender's memory stays held; then the first error is raised.

    Raises:
        ValueError, RuntimeError: see :func:`take`.
    """
    out, error = [], None
    for v in values:
        if isinstance(v, SharedTensor):
            try:
                v = take(v, device)
            except (ValueError, RuntimeError) as e:
                error = error or e
        out.append(v)
    if error is not None:
        raise error
    return out


def take_embeddings(msg: ImageEmbeddings, device: torch.device) -> ImageEmbeddings | None:
    """``msg`` with its shared embeddings taken onto ``device`` (see :func:`take_all`); None, logged with the
    request id, when one cannot be mapped: the request then waits for embeddings until its deadline."""
    if not any(isinstance(e, SharedTensor) for e in msg.embeddings):
        return msg
    try:
        return ImageEmbeddings(rid=msg.rid, image_hashes=msg.image_hashes,
                               embeddings=take_all(msg.embeddings, device))
    except (ValueError, RuntimeError) as e:
        log.error("rid=%s cannot take the encoder's embeddings from its GPU memory (%s): start this prefill server "
                  "with --kv-transfer zmq to receive them as bytes", msg.rid, e)
        return None
