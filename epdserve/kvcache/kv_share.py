"""KV hand-off between two servers on one machine without host staging: the decode server maps the prefill
server's KV pool and copies a request's pages out of it, device to device.

On CUDA the pool buffer is exported with a CUDA IPC memory handle (``cudaIpcGetMemHandle`` through torch's
``UntypedStorage._share_cuda_``, the call ``torch.multiprocessing`` makes, here without pickle: the handle's
fields travel in a msgpack :class:`~epdserve.wire.messages.KVPoolHandle`). On the CPU the pool is allocated in a file
under /dev/shm that both processes map. Either way only a handle crosses the socket, once per request, and the
prefill server keeps the pages until the decode server's :class:`~epdserve.wire.messages.KVAck` says it copied them.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import torch

from epdserve.wire.codec import FLOAT_DTYPE_NAMES
from epdserve.wire.messages import KVPoolHandle

log = logging.getLogger(__name__)



KV_TRANSFER_MODES = ("auto", "zmq", "shared", "nixl", "mooncake")  # the last two: epdserve.kvcache.engine


def shares_kv(mode: str, device: torch.device) -> bool:
    """Whether a server on ``device`` with ``--kv-transfer mode`` shares its KV pool (prefill) or maps a peer's
    (decode). Sharing only offers the path: a prefill/decode pair uses it when both share and run on one machine,
    else the host path.

    ``auto`` (the default) shares on CUDA (CUDA IPC: no host staging) and not on the CPU, where the pool would
    have to live in a /dev/shm file, which containers often keep small.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in KV_TRANSFER_MODES:
        raise ValueError(f"--kv-transfer must be one of {KV_TRANSFER_MODES}, got {mode!r}")
    return mode == "shared" or (mode == "auto" and device.type == "cuda")


def host_id() -> str:
    """This machine's identity for "same host" checks: the kernel boot id and the host name (two containers
    of one host share the boot id; the host name tells them apart, since CUDA IPC needs one IPC namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}/{socket.gethostname()}"


def new_shm_path() -> str:
    """A fresh /dev/shm file name for a CPU KV pool that other processes may map."""
    return f"/dev/shm/epdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def export_pool(buffer: torch.Tensor, shm_path: str = "") -> KVPoolHandle:
    """The handle of a KV pool ``buffer`` ``[L, 2, num_pages, page_size, H, D]`` (a whole, contiguous tensor).

    Raises:
        ValueError: a CPU buffer without ``shm_path`` (it is not in shared memory).
    """
    dtype = str(buffer.dtype).removeprefix("torch.")
    if buffer.is_cuda:
        ipc = list(buffer.untyped_storage()._share_cuda_())
        return KVPoolHandle(host_id=host_id(), shape=list(buffer.shape), dtype=dtype, cuda_ipc=ipc)
    if not shm_path:
        raise ValueError("a CPU KV pool can only be shared when it lives in a /dev/shm file")
    return KVPoolHandle(host_id=host_id(), shape=list(buffer.shape), dtype=dtype, shm_path=shm_path)


def open_pool(handle: KVPoolHandle) -> torch.Tensor:
    """Map a peer's KV pool: a tensor of ``handle.shape`` and dtype aliasing the peer's memory (CUDA: on the
    peer's device index; CPU: the /dev/shm file).

    Raises:
        ValueError: an unknown dtype or a handle with neither CUDA IPC fields nor a shm path.
        RuntimeError: the mapping fails (another machine, another IPC namespace, the peer exited).
    """
    if handle.dtype not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"unknown KV pool dtype {handle.dtype!r}")
    dtype, shape = getattr(torch, handle.dtype), tuple(handle.shape)
    numel = 1
    for n in shape:
        numel *= n
    if handle.cuda_ipc:
        if len(handle.cuda_ipc) != 8:
            raise ValueError("CUDA IPC handle must have 8 fields")
        device = int(handle.cuda_ipc[0])
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(*handle.cuda_ipc)
        flat = torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(storage, 0, (numel,), (1,))
        return flat.view(shape)
    if handle.shm_path:
        if not handle.shm_path.startswith("/dev/shm/epdserve-kv-") or "/" in handle.shm_path[9:]:
            raise ValueError(f"not an epdserve KV pool file: {handle.shm_path!r}")
        # from_file would create a missing file (zeros): a peer that exited must be an error, not empty KV.
        if not os.path.isfile(handle.shm_path) or os.path.getsize(handle.shm_path) != numel * dtype.itemsize:
            raise RuntimeError(f"KV pool file {handle.shm_path} is missing or has the wrong size")
        return torch.from_file(handle.shm_path, shared=True, size=numel, dtype=dtype).view(shape)
    raise ValueError("KV pool handle has neither CUDA IPC fields nor a shm path")


class PeerPools:
    """The prefill KV pools this decode server has mapped, by handle (mapping costs milliseconds; a pool is
    mapped once per prefill process). Owned by one scheduler loop."""

    def __init__(self):
        self._pools: dict[tuple, torch.Tensor] = {}

    def tensor(self, handle: KVPoolHandle) -> torch.Tensor:
        """The mapped tensor of ``handle`` as its shape says (a hybrid prefill server's state buffers); mapped once
        per handle like the pools; see :func:`open_pool` for errors."""
        # The whole IPC handle: two buffers of one process may share an allocation block (same handle bytes).
        key = ("tensor", handle.shm_path, repr(handle.cuda_ipc))
        if key not in self._pools:
            self._pools[key] = open_pool(handle)
        return self._pools[key]

    def get(self, handle: KVPoolHandle) -> torch.Tensor:
        """The mapped pool of ``handle`` (``[L, 2, num_pages * page_size, H, D]``, slot-indexed); see
        :func:`open_pool` for errors."""
        key = (handle.shm_path, bytes(handle.cuda_ipc[1]) if handle.cuda_ipc else b"")
        if key not in self._pools:
            pool = open_pool(handle)
            L, two, P, ps, H, D = pool.shape
            self._pools[key] = pool.view(L, two, P * ps, H, D)
            log.info("mapped a prefill KV pool (%s, %.0f MiB)", "CUDA IPC" if handle.cuda_ipc else "shm",
                     pool.numel() * pool.element_size() / 2**20)
        return self._pools[key]
