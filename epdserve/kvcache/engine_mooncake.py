"""The Mooncake transfer engine (``--kv-transfer mooncake``; ``pip install 'epdserve[mooncake]'``): Mooncake's
``TransferEngine`` with the P2P handshake (no metadata server: a peer is named ``host:rpc_port``), over RDMA when
this machine has an RDMA device and TCP otherwise.

Its Python binding offers no pollable one-sided write without a batch wait, so each write runs
``batch_transfer_sync_write`` on a worker thread (the binding releases the GIL while it waits) and
:meth:`MooncakeEngine.poll` asks the thread's future.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from mooncake.engine import TransferEngine

from epdserve.kvcache.engine import KVEngine, KVEngineError
from epdserve.wire.messages import KVEngineRegion

log = logging.getLogger(__name__)

# Mooncake's TCP transport queues a batch's writes on its lanes and fails a whole batch beyond their queues ("TCP
# lane queue-full", -1: on an H100 every ~17k-write batch of a 3.8k-token prompt failed; on the CPU 4096 writes
# failed and 1024 did not), so a write of many descriptors (scattered pages, the per-token head slices of different
# TP sizes: epdserve.kvcache.engine_copies) goes as batches of at most this many, in turn. 256 is what the H100
# figures in docs/performance.md ran with.
_MAX_BATCH = 256


def _protocol() -> str:
    """``rdma`` when this machine has an RDMA device (/sys/class/infiniband), else ``tcp``."""
    import os

    return "rdma" if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband") else "tcp"


class MooncakeEngine(KVEngine):
    """A Mooncake ``TransferEngine`` listening on ``host``.

    Raises:
        KVEngineError: it cannot start.
    """

    name = "mooncake"

    def __init__(self, host: str):
        super().__init__()
        self.te = TransferEngine()
        proto = _protocol()
        if self.te.initialize(host, "P2PHANDSHAKE", proto, "") != 0:
            raise KVEngineError(f"Mooncake transfer engine cannot start on {host} ({proto})")
        self._session = f"{host}:{self.te.get_rpc_port()}"
        # A few workers: a write blocked on a stalled peer must not hold back writes to the others.
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mooncake-write")
        self._registered: list[int] = []  # addresses: the KV pool's, then a hybrid model's state buffers'

    def _register(self, buffer: torch.Tensor) -> None:
        if self.te.register_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size()) != 0:
            raise KVEngineError(f"Mooncake cannot register the {'state' if self._registered else 'KV'} pool")
        self._registered.append(buffer.data_ptr())

    def agent_name(self) -> str:
        return self._session

    def submit(self, peer: KVEngineRegion, copies: list[tuple[int, int, int]]) -> Future:
        src, dst, lengths = ([c[i] for c in copies] for i in range(3))
        return self._pool.submit(self._write, peer.agent, src, dst, lengths)

    def _write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        """Write the batches of at most :data:`_MAX_BATCH` one after another; the first failure's return code."""
        for i in range(0, len(src), _MAX_BATCH):
            end = i + _MAX_BATCH
            if rc := self.te.batch_transfer_sync_write(peer, src[i:end], dst[i:end], lengths[i:end]):
                return rc
        return 0

    def poll(self, handle: Future) -> bool:
        if not handle.done():
            return False
        try:
            rc = handle.result()
        except Exception as e:
            raise KVEngineError(f"Mooncake write failed: {e}") from e
        if rc != 0:
            raise KVEngineError(f"Mooncake write failed (return code {rc})")
        return True

    def cancel(self, handle: Future) -> None:
        handle.cancel()  # a write already running finishes (or fails) on its own; its result is dropped

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for address in self._registered:
            self.te.unregister_memory(address)
        self._registered = []
