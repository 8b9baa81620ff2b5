"""KV hand-off through a transfer engine (``--kv-transfer nixl|mooncake``): the prefill server writes a request's
prompt KV pages straight into the pages its decode server reserved for it, one-sided, across processes or hosts.

The flow (as SGLang's Mooncake/NIXL connectors; Dynamo and vLLM use NIXL the same way): the decode server
registers its whole KV pool with the engine at start and, when it registers for a request at the prefill
bootstrap, sends a :class:`~epdserve.wire.messages.KVEngineRegion` (where its pool lives) and the request's
pages (reserved at once for the prompt and the output). The prefill server registers its own pool, and once the
request is prefilled writes every layer's K and V of the prompt's pages into the decode pages (what each write
moves: :mod:`epdserve.kvcache.engine_copies`), waits for the engine to finish, then sends a tensor-less
:class:`~epdserve.wire.messages.KVTransfer`. A TP server runs one engine per rank, each with its rank's pool
shard registered: every decode rank's region travels at bootstrap, every prefill rank writes its KV heads into
the decode ranks holding them, and prefill rank 0 sends the transfer once all ranks' writes have landed
(:mod:`epdserve.kvcache.rank_writes`). Decode acknowledges; prefill frees its pages on the ack (or its
deadline). A hybrid model (Qwen3.5) registers its state pool's two buffers too (:meth:`KVEngine.register_state`):
decode names its request's state slot at bootstrap, and each prefill rank writes its DeltaNet heads of the request's
slot into it in the same writes as the KV pages (:mod:`epdserve.kvcache.state_copies`). The engines are optional
dependencies, imported only when asked for (:func:`make_engine`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from epdserve.kvcache.engine_names import KV_ENGINES
from epdserve.kvcache.state_copies import describe_state
from epdserve.wire.messages import KVEngineRegion, StateEngineRegion


class KVEngineError(RuntimeError):
    """A transfer engine failed: it cannot start, register memory, reach the peer, or a write failed."""


class KVEngine(ABC):
    """One process's transfer engine: one registered KV pool, writes into peers' registered pools.

    Subclasses own one engine instance (NIXL agent, Mooncake ``TransferEngine``); the scheduler loop that owns
    the :class:`KVEngine` is the only caller (no locking).
    """

    name = ""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.head_start = 0
        self.state: StateEngineRegion | None = None  # the state pool registered beside the KV pool (hybrid models)

    def register(self, buffer: torch.Tensor, head_start: int = 0) -> None:
        """Register the KV pool ``buffer`` ``[L, 2, num_pages, page_size, H, D]`` (contiguous, CPU or CUDA) so
        peers may write into it and this process may write out of it; it holds the model's KV heads
        ``head_start .. head_start + H - 1`` (this TP rank's shard).

        Raises:
            KVEngineError: the engine refused the memory.
        """
        if not buffer.is_contiguous():
            raise KVEngineError("a KV pool must be contiguous to be registered")
        self._register(buffer)
        self.buffer, self.head_start = buffer, head_start

    def register_state(self, conv: torch.Tensor, recurrent: torch.Tensor, key_start: int, value_start: int) -> None:
        """Register a hybrid model's state pool beside the KV pool (call :meth:`register` first): ``conv``
        ``[layers, slots + 1, conv_dim, kernel]`` and ``recurrent`` ``[layers, slots + 1, value_heads, key_dim,
        value_dim]`` (a :class:`~epdserve.kvcache.state_pool.StatePool`'s buffers, on the KV pool's device),
        holding the model's DeltaNet key heads from ``key_start`` and value heads from ``value_start`` on.

        Raises:
            KVEngineError: no KV pool registered yet, buffers not contiguous or not on its device, or the engine
                refused the memory.
        """
        if self.buffer is None:
            raise KVEngineError("register the KV pool before the state pool")
        if conv.device != self.buffer.device or recurrent.device != self.buffer.device:
            raise KVEngineError(f"state pool on {conv.device}/{recurrent.device}, KV pool on {self.buffer.device}: "
                                f"one engine write moves both")
        try:
            region = describe_state(conv, recurrent, key_start, value_start)
        except ValueError as e:
            raise KVEngineError(str(e)) from e
        self._register(conv)
        self._register(recurrent)
        self.state = region

    def describe(self) -> KVEngineRegion:
        """The descriptor a peer needs to write into the registered pool (sent in ``KVRegister``), with the
        state pool's when one is registered."""
        b = self.buffer
        return KVEngineRegion(engine=self.name, agent=self.agent_name(), base=b.data_ptr(), shape=list(b.shape),
                              dtype=str(b.dtype).removeprefix("torch."), gpu=b.device.index if b.is_cuda else -1,
                              metadata=self.agent_metadata(), head_start=self.head_start, state=self.state)

    @abstractmethod
    def _register(self, buffer: torch.Tensor) -> None:
        """Register ``buffer`` (contiguous; the KV pool first, then any state buffers, all on one device) for
        writes out of it and into it; a later call adds a buffer."""

    @abstractmethod
    def agent_name(self) -> str:
        """This engine's address as peers name it."""

    def agent_metadata(self) -> bytes:
        """What a peer needs to connect to this engine besides :meth:`agent_name` (NIXL's agent metadata)."""
        return b""

    @abstractmethod
    def submit(self, peer: KVEngineRegion, copies: list[tuple[int, int, int]]):
        """Start writing ``copies`` ``(local address, peer address, bytes)`` from the registered buffers (KV pool,
        state pool) into ``peer``'s; returns a handle for :meth:`poll`.

        Raises:
            KVEngineError: the peer cannot be reached or the write cannot start.
        """

    @abstractmethod
    def poll(self, handle) -> bool:
        """True once the write of ``handle`` has completed at the peer (the handle is then spent).

        Raises:
            KVEngineError: the write failed (the handle is spent).
        """

    def cancel(self, handle) -> None:
        """Give up on an unfinished write (its request ended): release what the engine holds for it."""

    def progress(self) -> None:
        """Let the engine answer its peers (UCX's connection set-up to a pool written into) where it runs no
        thread of its own for that; cheap. A server written into calls it every loop turn."""

    def close(self) -> None:
        """Release the engine (deregister memory, stop its threads)."""


def make_engine(name: str, host: str) -> KVEngine:
    """A started engine ``name`` (``nixl`` or ``mooncake``) listening on ``host`` (this server's address).

    Raises:
        ValueError: an unknown engine name.
        KVEngineError: its Python package is not installed (``pip install 'epdserve[<name>]'``) or it cannot start.
    """
    if name not in KV_ENGINES:
        raise ValueError(f"unknown KV transfer engine {name!r}; one of {sorted(KV_ENGINES)}")
    module, cls, install = KV_ENGINES[name]
    try:
        impl = getattr(importlib.import_module(module), cls)
    except ImportError as e:  # not installed, or a build whose shared libraries this machine lacks
        raise KVEngineError(f"--kv-transfer {name} cannot import its package ({e}); {install}") from e
    return impl(host)
