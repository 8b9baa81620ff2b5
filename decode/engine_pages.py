"""Decode pages offered to a transfer engine (``--kv-transfer nixl|mooncake``, :mod:`epdserve.kvcache.engine`):
reserved when a request arrives and named in its ``KVRegister``, for the prefill server to write the prompt's KV
straight into; held back after an abort or a KV deadline until the request's ``KVTransfer`` still comes or the
timeout passes, since a write already in flight may yet land in them (reusing them at once could corrupt another
request's KV).

A request of ``n > 1`` choices reserves its forks' pages (:mod:`epdserve.decode.forks`) the same way: the
prompt's full pages (shared), then each fork's own pages; the pages it names are fork 0's (the shared ones, then
its own), so the engine writes the prompt into fork 0 and decode copies the partial last page into the other
forks' own first pages at admission.
"""

from __future__ import annotations

import time

from epdserve.decode.forks import fork_pages
from epdserve.kvcache.engine import KVEngine
from epdserve.kvcache.page_pool import PagePool
from epdserve.wire.messages import DecodeRequest, KVEngineRegion


class EnginePages:
    """The decode side's pages reserved for transfer engine writes.

    Args:
        pool: the decode server's page pool (reservations come out of it and go back to it).
        engine: the transfer engine with that pool registered (rank 0's shard on a TP server), or None (no
            engine: nothing is ever reserved).
        timeout_s: how long pages stay held back after their request was dropped (the KV wait's timeout).
        rank_regions: the other TP ranks' regions, in rank order (their engines, their pool shards): the pages
            reserved are the same page ids on every rank.
    """

    def __init__(self, pool: PagePool, engine: KVEngine | None, timeout_s: float,
                 rank_regions: list[KVEngineRegion] = ()):
        self.pool, self.timeout_s, self.engine = pool, timeout_s, engine
        self.regions = [engine.describe(), *rank_regions] if engine is not None else []
        self._held_back: dict[int, tuple[float, list[int]]] = {}  # room -> (time.monotonic() deadline, pages)

    def reserve(self, msg: DecodeRequest, context_length: int) -> tuple[list[KVEngineRegion], list[int]]:
        """``(regions, pages)`` for the ``KVRegister`` of ``msg``: every rank's region and the pages for its prompt
        and output (capped at ``context_length`` tokens) of every choice (the shared prompt pages, then each
        fork's own), allocated now; ``([], [])`` (the host path) without an engine or when too few pages are
        free."""
        total = min(msg.prompt_len + msg.sampling.max_new_tokens, context_length)
        shared, own = fork_pages(self.pool, msg.prompt_len, total, msg.sampling.n)
        need = shared + msg.sampling.n * own
        if not self.regions or need > self.pool.num_free:
            return [], []
        return list(self.regions), self.pool.alloc(need)

    def hold_back(self, room: int, pages: list[int]) -> None:
        """Keep ``pages`` of dropped request ``room`` (nothing when empty) until :meth:`late_transfer` or
        :meth:`expire` frees them."""
        if pages:
            self._held_back[room] = (time.monotonic() + self.timeout_s, pages)

    def late_transfer(self, room: int) -> None:
        """A ``KVTransfer`` for dropped request ``room`` came: its engine write has ended, free its pages."""
        held = self._held_back.pop(room, None)
        if held is not None:
            self.pool.free(held[1])

    def tick(self) -> None:
        """Every loop turn: let the engine progress (:meth:`KVEngine.progress`), and free held-back pages whose
        timeout has passed (the write can no longer be in flight)."""
        if self.engine is not None:
            self.engine.progress()
        now = time.monotonic()
        for room in [r for r, (until, _) in self._held_back.items() if until < now]:
            self.pool.free(self._held_back.pop(room)[1])
