"""One TP rank's transfer engine writes (``--kv-transfer nixl|mooncake``): for each request (by bootstrap room),
the rank's KV heads of the prompt's pages into every decode rank's pool that holds them, one engine write per
rank pair (:func:`epdserve.kvcache.engine_copies.page_copies`), followed until every one of them has ended. For a
hybrid model (Qwen3.5) the same write of each rank pair also moves the rank's DeltaNet heads of the request's
state slot into the decode slot (:func:`epdserve.kvcache.state_copies.state_copies`).

Prefill rank 0 runs one (:class:`epdserve.prefill.transfers.EngineWriter`) and so does every other prefill rank
(:mod:`epdserve.engine.tp_follower`), each on its own engine and pool shard. A request's writes end only when all
of them did, failed or not: a rank reports a failure once its other writes can no longer land either, so the
decode server, told of the failure, may free the pages at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epdserve.kvcache.engine import KVEngine, KVEngineError
from epdserve.kvcache.engine_copies import check_region, page_copies, writer_heads
from epdserve.kvcache.state_copies import check_state_region, state_copies
from epdserve.wire.messages import KVEngineRegion


@dataclass
class _Writes:
    handles: list  # the engine's, of writes not ended yet
    nbytes: int  # KV
    state_bytes: int = 0
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
        state_heads: a hybrid model's DeltaNet ``(key heads, value heads)`` (regions' state pools are checked
            against them); its state pool is the one ``engine`` registered (``engine.state``). None: no state.
    """

    def __init__(self, engine: KVEngine, buffer: torch.Tensor, own_start: int, heads: tuple[int, int],
                 num_kv_heads: int, state_heads: tuple[int, int] | None = None):
        self.engine, self.buffer, self.own_start, self.heads = engine, buffer, own_start, heads
        self.num_kv_heads, self.state_heads = num_kv_heads, state_heads
        if state_heads is not None and engine.state is None:
            raise ValueError("a hybrid model's writes need its state pool registered with the engine")
        self._writes: dict[int, _Writes] = {}

    @classmethod
    def for_runner(cls, engine: KVEngine, runner) -> RankWrites:
        """The writes of ``runner``'s TP rank (a ``ModelRunner``: ``tp``, ``config``, ``kv_pool``, ``heads``,
        ``state_pool``), out of the pools :func:`epdserve.engine.server.register_kv_engine` registered with
        ``engine``: its writer KV heads (:func:`~epdserve.kvcache.engine_copies.writer_heads`), and for a hybrid
        model its DeltaNet heads."""
        cfg = runner.config
        state = (cfg.linear_num_key_heads, cfg.linear_num_value_heads) if runner.state_pool is not None else None
        return cls(engine, runner.kv_pool.buffer, runner.heads.kv_start,
                   writer_heads(cfg.num_heads, cfg.num_kv_heads, runner.tp.size, runner.tp.rank), cfg.num_kv_heads,
                   state)

    @property
    def busy(self) -> bool:
        """True while some write has not ended (poll :meth:`poll`)."""
        return bool(self._writes)

    def start(self, room: int, src_pages: list[int], n_tokens: int, regions: list[KVEngineRegion],
              dst_pages: list[int], src_slot: int = -1, dst_slot: int = -1) -> str | None:
        """Start writing the first ``n_tokens`` tokens' KV (this rank's heads) of ``src_pages`` into ``dst_pages``
        of each of ``regions`` that holds some of them, and for a hybrid model this rank's DeltaNet heads of
        state slot ``src_slot`` into slot ``dst_slot`` of each region's state pool holding some (the request's
        final prompt state: the forward that computed it has run). Returns why it cannot (nothing was started
        then: a region of another layout, no state slot, a write the engine refuses), else None."""
        if room in self._writes:
            return f"a write for room {room} is already running"
        for region in regions:
            if region.engine != self.engine.name:
                return f"decode offers a {region.engine} region to a {self.engine.name} engine"
            if err := check_region(region, self.buffer, dst_pages, n_tokens, self.num_kv_heads):
                return err
            if self.state_heads is not None and (err := check_state_region(region.state, self.engine.state, dst_slot,
                                                                           *self.state_heads)):
                return err
        writes = _Writes([], 0)
        for region in regions:
            copies = page_copies(self.buffer, src_pages, region, dst_pages, n_tokens, own_start=self.own_start,
                                 heads=self.heads)
            state = [] if self.state_heads is None else state_copies(self.engine.state, src_slot, region.state,
                                                                     dst_slot)
            if not copies and not state:
                continue
            try:
                writes.handles.append(self.engine.submit(region, copies + state))  # one write: KV and state
            except KVEngineError as e:
                for h in writes.handles:
                    self.engine.cancel(h)
                return str(e)
            writes.nbytes += sum(c[2] for c in copies)
            writes.state_bytes += sum(c[2] for c in state)
        self._writes[room] = writes
        return None

    def poll(self) -> list[tuple[int, int, int, str]]:
        """``(room, KV bytes written, state bytes written, error or "")`` of each room whose writes have all ended
        since the last call (no bytes when one failed)."""
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
                ok = not w.errors
                out.append((room, w.nbytes if ok else 0, w.state_bytes if ok else 0, "; ".join(w.errors)))
        return out

    def cancel(self, room: int) -> None:
        """Give up ``room``'s writes (its request ended); nothing is reported for it."""
        w = self._writes.pop(room, None)
        for h in w.handles if w is not None else ():
            self.engine.cancel(h)
