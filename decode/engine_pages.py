"""Decode pages offered to a transfer engine (``--kv-transfer nixl|mooncake``, :mod:`epdserve.kvcache.engine`):
reserved when a request arrives and named in its ``KVRegister``, for the prefill server to write the prompt's KV
straight into; held back after an abort or a KV deadline until the request's ``KVTransfer`` still comes or the
timeout passes, since a write already in flight may yet land in them (reusing them at once could corrupt another
request's KV). A hybrid model's (Qwen3.5) request also reserves its state slot at arrival, named in the
``KVRegister`` too, for the prefill server to write the request's final prompt state into, and held back with
the pages.

A request of ``n > 1`` choices reserves its forks' pages (:mod:`epdserve.decode.forks`) the same way: the
prompt's full pages (shared), then each fork's own pages; the pages it names are fork 0's (the shared ones, then
its own), so the engine writes the prompt into fork 0 and decode copies the partial last page into the other
forks' own first pages at admission.
"""

from __future__ import annotations

import time
from collections import deque

from epdserve.decode.forks import fork_pages
from epdserve.kvcache.engine import KVEngine
from epdserve.kvcache.page_pool import PagePool
from epdserve.kvcache.state_slots import StateSlots
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
        states: the decode server's state slots (a hybrid model's request reserves one, by its fork 0's key).
    """

    def __init__(self, pool: PagePool, engine: KVEngine | None, timeout_s: float,
                 rank_regions: list[KVEngineRegion] = (), states: StateSlots | None = None):
        self.pool, self.timeout_s, self.engine = pool, timeout_s, engine
        self.states = states if states is not None else StateSlots(None)
        self.regions = [engine.describe(), *rank_regions] if engine is not None else []
        # room -> (time.monotonic() deadline, pages, state-slot key)
        self._held_back: dict[int, tuple[float, list[int], object]] = {}

    def reserve(self, msg: DecodeRequest, context_length: int, key) -> tuple[list[KVEngineRegion], list[int], int]:
        """``(regions, pages, state slot)`` for the ``KVRegister`` of ``msg``: every rank's region, the pages for
        its prompt and output (capped at ``context_length`` tokens) of every choice (the shared prompt pages, then
        each fork's own) and, for a hybrid model, a state slot held by ``key`` (else -1), allocated now;
        ``([], [], -1)`` (the host path) without an engine or when too few pages or no slot are free."""
        total = min(msg.prompt_len + msg.sampling.max_new_tokens, context_length)
        shared, own = fork_pages(self.pool, msg.prompt_len, total, msg.sampling.n)
        need = shared + msg.sampling.n * own
        if not self.regions or need > self.pool.num_free or (slot := self.states.reserve(key)) is None:
            return [], [], -1
        return list(self.regions), self.pool.alloc(need), slot

    def hold_back(self, room: int, pages: list[int], key) -> None:
        """Keep ``pages`` and the state slot of ``key`` of dropped request ``room`` (nothing when it reserved no
        pages) until :meth:`late_transfer` or :meth:`tick` frees them."""
        if pages:
            self._held_back[room] = (time.monotonic() + self.timeout_s, pages, key)

    def late_transfer(self, room: int) -> None:
        """A ``KVTransfer`` for dropped request ``room`` came: its engine write has ended, free its pages and slot."""
        if room in self._held_back:
            self._free(room)

    def tick(self) -> None:
        """Every loop turn: let the engine progress (:meth:`KVEngine.progress`), and free held-back pages and slots
        whose timeout has passed (the write can no longer be in flight)."""
        if self.engine is not None:
            self.engine.progress()
        now = time.monotonic()
        for room in [r for r, (until, _, _) in self._held_back.items() if until < now]:
            self._free(room)

    def _free(self, room: int) -> None:
        _, pages, key = self._held_back.pop(room)
        self.pool.free(pages)
        self.states.release(key)


def jump_reserved(ready: deque) -> bool:
    """Move to the front of decode's ``ready`` queue (requests whose KV has come, first come first served) the first
    request behind its head that needs nothing more to run: an engine-written one of one choice, whose pages and
    state slot were all reserved at arrival; returns whether there was one. The head waits for pages or a state
    slot; such a request takes none it could get, and without the jump, reservations held by requests queued behind
    the head with none running would never come back (a host-path request registered when every slot was reserved,
    whose KV came first)."""
    for seq in list(ready)[1:]:
        if seq.transfer is not None and seq.transfer.engine_written and seq.msg.sampling.n == 1:
            ready.remove(seq)
            ready.appendleft(seq)
            return True
    return False
