"""The NIXL transfer engine (``--kv-transfer nixl``; ``pip install 'epdserve[nixl]'``): NVIDIA's NIXL agent with its
UCX backend, which writes host memory (DRAM) or GPU memory (VRAM, GPUDirect RDMA where the NIC allows) one-sided
over whatever UCX finds (shared memory, TCP, InfiniBand/RoCE). Peers connect from the agent metadata blob that
travels in :class:`~epdserve.wire.messages.KVEngineRegion` (no metadata server)."""

from __future__ import annotations

import logging
import uuid

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from epdserve.kvcache.engine import KVEngine, KVEngineError
from epdserve.wire.messages import KVEngineRegion

log = logging.getLogger(__name__)


def _descs(addresses: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """NIXL's Nx3 descriptor table (uint64): address, bytes, device id per row."""
    return np.stack([addresses, lengths, np.full_like(addresses, device)], axis=1)


class NixlEngine(KVEngine):
    """A NIXL agent (UCX backend) named uniquely per process, so a restarted peer is a new agent. The agent
    starts when the KV pool is registered, since its device decides the agent's progress thread.

    Raises:
        KVEngineError: the agent or its UCX backend cannot start (at :meth:`register`).
    """

    name = "nixl"

    def __init__(self, host: str):
        super().__init__()
        self._name = f"epdserve-{host}-{uuid.uuid4().hex[:12]}"
        self.agent, self._progress_thread = None, False
        self._peers: set[str] = set()
        self._regs: list = []  # NIXL's registrations: the KV pool's, then a hybrid model's state buffers'

    def _register(self, buffer: torch.Tensor) -> None:
        if self.agent is None:
            self._start_agent(buffer)
        try:
            self._regs.append(self.agent.register_memory(buffer))  # DRAM or VRAM, as the tensor's device says
        except Exception as e:
            raise KVEngineError(f"NIXL cannot register the {'state' if self._regs else 'KV'} pool: {e}") from e

    def _start_agent(self, buffer: torch.Tensor) -> None:
        # nixl's Python API runs UCX's progress thread with no pause between polls: a core spun per process. With
        # the KV on the GPU that core is spare, and the thread answers peers at once (on an H100, without it the
        # servers' time to the first output was ~10 ms longer). With the KV in host memory the forward needs every
        # core (on the 2-core CPU machine the thread slowed prefill's forward ~10x: a 789-token prompt's TTFT 1.0 s
        # against 0.08 s over zmq), so there is none: a writer progresses its writes when it polls them, a pool
        # written into in progress(), which its server's loop calls every turn.
        self._progress_thread = buffer.is_cuda
        try:
            self.agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=self._progress_thread,
                                                                  backends=["UCX"]))
        except Exception as e:  # nixl raises its own binding errors
            raise KVEngineError(f"NIXL agent with the UCX backend cannot start: {e}") from e

    def agent_name(self) -> str:
        return self._name

    def agent_metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def submit(self, peer: KVEngineRegion, copies: list[tuple[int, int, int]]):
        local = self.buffer
        mem, dev = ("VRAM", local.device.index) if local.is_cuda else ("DRAM", 0)
        peer_mem, peer_dev = ("VRAM", peer.gpu) if peer.gpu >= 0 else ("DRAM", 0)
        try:
            if peer.agent not in self._peers:
                self.agent.add_remote_agent(peer.metadata)
                self._peers.add(peer.agent)
            # Nx3 arrays (address, bytes, device): NIXL builds its descriptor lists from them far faster than from
            # tuples (15k per-token head slices: ~5 ms instead of ~160 ms).
            table = np.array(copies, dtype=np.uint64).reshape(-1, 3)
            src = self.agent.get_xfer_descs(_descs(table[:, 0], table[:, 2], dev), mem)
            dst = self.agent.get_xfer_descs(_descs(table[:, 1], table[:, 2], peer_dev), peer_mem)
            handle = self.agent.initialize_xfer("WRITE", src, dst, peer.agent)
            if self.agent.transfer(handle) == "ERR":
                self.agent.release_xfer_handle(handle)
                raise KVEngineError(f"NIXL write to {peer.agent} failed to start")
        except KVEngineError:
            self._forget(peer.agent)
            raise
        except Exception as e:
            self._forget(peer.agent)
            raise KVEngineError(f"NIXL write to {peer.agent} failed: {e}") from e
        return peer.agent, handle

    def progress(self) -> None:
        if self.agent is not None and not self._progress_thread:
            self.agent.get_new_notifs()  # progresses the UCX workers

    def poll(self, handle) -> bool:
        agent, h = handle
        state = self.agent.check_xfer_state(h)
        if state == "PROC":
            return False
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            self._forget(agent)  # a dead or restarted peer: connect afresh next time
            raise KVEngineError(f"NIXL write to {agent} failed ({state})")
        return True

    def cancel(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle[1])  # aborts the transfer if it is still running
        except Exception as e:
            log.warning("NIXL could not release a transfer: %s", e)

    def _forget(self, agent: str) -> None:
        if agent in self._peers:
            self._peers.discard(agent)
            try:
                self.agent.remove_remote_agent(agent)
            except Exception as e:
                log.debug("NIXL could not remove agent %s: %s", agent, e)

    def close(self) -> None:
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs = []
