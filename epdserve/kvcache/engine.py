"""KV hand-off through a transfer engine (``--kv-transfer nixl|mooncake``): the prefill server writes a request's
prompt KV pages straight into the pages its decode server reserved for it, one-sided, across processes or hosts.

The flow (as SGLang's Mooncake/NIXL connectors; Dynamo and vLLM use NIXL the same way): the decode server
registers its whole KV pool with the engine at start and, when it registers for a request at the prefill
bootstrap, sends a :class:`~epdserve.wire.messages.KVEngineRegion` (where its pool lives) and the request's
pages (reserved at once for the prompt and the output). The prefill server registers its own pool, and once the
request is prefilled writes every layer's K and V of the prompt's pages into the decode pages (one write per
page per layer and K/V, contiguous in both pools), waits for the engine to finish, then sends a tensor-less
:class:`~epdserve.wire.messages.KVTransfer`. Decode acknowledges; prefill frees its pages on the ack (or its
deadline). The engines are optional dependencies, imported only when asked for (:func:`make_engine`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from epdserve.wire.codec import FLOAT_DTYPES
from epdserve.wire.messages import KVEngineRegion

# name -> (module, class, how to install its package)
KV_ENGINES = {"nixl": ("epdserve.kvcache.engine_nixl", "NixlEngine", "pip install 'epdserve[nixl]'"),
              "mooncake": ("epdserve.kvcache.engine_mooncake", "MooncakeEngine",
                           "pip install 'epdserve[mooncake]' (its CUDA build: needs libcudart.so.12), or "
                           "'epdserve[mooncake-cpu]' on a machine without CUDA (needs libibverbs.so.1)")}


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

    def register(self, buffer: torch.Tensor) -> None:
        """Register the KV pool ``buffer`` ``[L, 2, num_pages, page_size, H, D]`` (contiguous, CPU or CUDA) so
        peers may write into it and this process may write out of it.

        Raises:
            KVEngineError: the engine refused the memory.
        """
        if not buffer.is_contiguous():
            raise KVEngineError("a KV pool must be contiguous to be registered")
        self._register(buffer)
        self.buffer = buffer

    def describe(self) -> KVEngineRegion:
        """The descriptor a peer needs to write into the registered pool (sent in ``KVRegister``)."""
        b = self.buffer
        return KVEngineRegion(engine=self.name, agent=self.agent_name(), base=b.data_ptr(), shape=list(b.shape),
                              dtype=str(b.dtype).removeprefix("torch."), gpu=b.device.index if b.is_cuda else -1,
                              metadata=self.agent_metadata())

    @abstractmethod
    def _register(self, buffer: torch.Tensor) -> None: ...

    @abstractmethod
    def agent_name(self) -> str:
        """This engine's address as peers name it."""

    def agent_metadata(self) -> bytes:
        """What a peer needs to connect to this engine besides :meth:`agent_name` (NIXL's agent metadata)."""
        return b""

    @abstractmethod
    def submit(self, peer: KVEngineRegion, copies: list[tuple[int, int, int]]):
        """Start writing ``copies`` ``(local address, peer address, bytes)`` from the registered pool into
        ``peer``'s; returns a handle for :meth:`poll`.

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


def check_region(region: KVEngineRegion, buffer: torch.Tensor, pages: list[int], n_tokens: int) -> str | None:
    """Why the prompt KV of ``n_tokens`` tokens in ``buffer`` cannot be written into ``pages`` of ``region``
    (None: it can): the two pools must have one layout but for the page count."""
    shape = list(buffer.shape)
    if region.dtype not in FLOAT_DTYPES or FLOAT_DTYPES[region.dtype] != buffer.dtype:
        return f"decode KV pool dtype {region.dtype} != prefill's {buffer.dtype}"
    if len(region.shape) != 6 or region.shape[:2] + region.shape[3:] != shape[:2] + shape[3:]:
        return f"decode KV pool shape {region.shape} does not match prefill's {shape} but for the page count"
    if len(pages) < -(-n_tokens // shape[3]) or any(not 0 <= p < region.shape[2] for p in pages):
        return f"decode registered {len(pages)} pages (or pages out of its pool) for a {n_tokens}-token prompt"
    return None


def page_copies(buffer: torch.Tensor, src_pages: list[int], region: KVEngineRegion, dst_pages: list[int],
                n_tokens: int) -> list[tuple[int, int, int]]:
    """The writes ``(source address, peer address, bytes)`` that move the first ``n_tokens`` tokens' KV, every
    layer's K and V, from ``src_pages`` of the pool ``buffer`` ``[L, 2, P, ps, H, D]`` into ``dst_pages`` of
    ``region`` (same layout, its own page count; see :func:`check_region`). The last page is written only as far
    as the prompt goes. Runs of pages consecutive on both sides become one write."""
    L, two, P, ps, H, D = buffer.shape
    token_bytes = H * D * buffer.element_size()
    page_bytes, peer_pages = ps * token_bytes, region.shape[2]
    n_pages = -(-n_tokens // ps)
    tail = (n_tokens - (n_pages - 1) * ps) * token_bytes
    runs = []  # (first src page, first dst page, pages, bytes of the last page)
    for i in range(n_pages):
        s, d, last = src_pages[i], dst_pages[i], tail if i == n_pages - 1 else page_bytes
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1, last)
        else:
            runs.append((s, d, 1, last))
    src_base, dst_base, out = buffer.data_ptr(), region.base, []
    for plane in range(L * two):  # layer l's K is plane 2l, its V 2l + 1
        for s, d, count, last in runs:
            out.append((src_base + (plane * P + s) * page_bytes, dst_base + (plane * peer_pages + d) * page_bytes,
                        (count - 1) * page_bytes + last))
    return out
