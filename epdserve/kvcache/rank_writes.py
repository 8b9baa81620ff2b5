"""One TP rank's transfer engine writes (``--kv-transfer nixl|mooncake``): for each request (by bootstrap room),
the rank's KV heads of the prompt's pages into every decode rank's pool that holds them, one engine write per
rank pair (:func:`epdserve.kvcache.engine_copies.page_copies`), followed until every one of them has ended.

Prefill rank 0 runs one (:class:`epdserve.prefill.transfers.EngineWriter`) and so does every other prefill rank
(:mod:`epdserve.engine.tp_follower`), each on its own engine and pool shard. A request's writes end only when all
of them did, failed or not: a rank reports a failure once its other writes can no longer land either, so the
decode server, told of the failure, may free the pages at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epdserve.kvcache.engine import KVEngine, KVEngineError
from epdserve.kvcache.engine_copies import check_region, page_copies
from epdserve.wire.messages import KVEngineRegion


@dataclass
class _Writes:
    handles: list  # the engine's, of writes not ended yet
    nbytes: int
    errors: list[str] = field(default_factory=list)


class RankWrites:
    """The engine writes of one TP rank, by bootstrap room.

    Args:
        engine: this rank's engine, with ``buffer`` registered.
        buffer: this rank's KV pool ``[L, 2, pages, page_size, H, D]``, holding KV heads from ``own_start`` on.
        own_start: the first of the model's KV heads in ``buffer``.
        heads: ``(first, count)``: the KV heads this rank writes
            (:func:`epdserve.kvcache.engine_copies.writer_heads`).
        num_kv_heads: the model's KV heads (regions are checked against it).
    """

    def __init__(self, engine: KVEngine, buffer: torch.Tensor, own_start: int, heads: tuple[int, int],
                 num_kv_heads: int):
        self.engine, self.buffer, self.own_start, self.heads = engine, buffer, own_start, heads
        self.num_kv_heads = num_kv_heads
        self._writes: dict[int, _Writes] = {}

    @property
    def busy(self) -> bool:
        """True while some write has not ended (poll :meth:`poll`)."""
        return bool(self._writes)

    def start(self, room: int, src_pages: list[int], n_tokens: int, regions: list[KVEngineRegion],
              dst_pages: list[int]) -> str | None:
        """Start writing the first ``n_tokens`` tokens' KV (this rank's heads) of ``src_pages`` into ``dst_pages``
        of each of ``regions`` that holds some of them. Returns why it cannot (nothing was started then: a region
        of another layout, a write the engine refuses), else None."""
        if room in self._writes:
            return f"a write for room {room} is already running"
        for region in regions:
            if region.engine != self.engine.name:
                return f"decode offers a {region.engine} region to a {self.engine.name} engine"
            if err := check_region(region, self.buffer, dst_pages, n_tokens, self.num_kv_heads):
                return err
        writes = _Writes([], 0)
        for region in regions:
            copies = page_copies(self.buffer, src_pages, region, dst_pages, n_tokens, own_start=self.own_start,
                                 heads=self.heads)
            if not copies:
                continue
            try:
                writes.handles.append(self.engine.submit(region, copies))
            except KVEngineError as e:
                for h in writes.handles:
                    self.engine.cancel(h)
                return str(e)
            writes.nbytes += sum(c[2] for c in copies)
        self._writes[room] = writes
        return None

    def poll(self) -> list[tuple[int, int, str]]:
        """``(room, bytes written, error or "")`` of each room whose writes have all ended since the last call."""
        out = []
        for room, w in list(self._writes.items()):
            running = []
            for h in w.handles:
                try:
                    if not self.engine.poll(h):
                        running.append(h)
                except KVEngineError as e:
                    w.errors.append(str(e))
            w.handles = running
            if not running:
                del self._writes[room]
                out.append((room, 0 if w.errors else w.nbytes, "; ".join(w.errors)))
        return out

    def cancel(self, room: int) -> None:
        """Give up ``room``'s writes (its request ended); nothing is reported for it."""
        w = self._writes.pop(room, None)
        for h in w.handles if w is not None else ():
            self.engine.cancel(h)
