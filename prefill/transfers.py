"""The ``KVTransfer`` a prefilled request hands to its decode server, on any path: its prompt's attention KV and,
for hybrid models (Qwen3.5), its DeltaNet state (:class:`~epdserve.kvcache.state_slots.StateSlots`); on the
transfer engine path (:mod:`epdserve.kvcache.engine`) the write into the decode pages that comes before it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from epdserve.kvcache.engine import KVEngine, KVEngineError
from epdserve.kvcache.rank_writes import RankWrites
from epdserve.kvcache.page_pool import PagePool
from epdserve.kvcache.state_slots import StateSlots
from epdserve.prefill.records import PrefillRecord
from epdserve.wire.messages import KVPoolHandle, KVTransfer, TPEngineWrite


def shared_transfer(req: PrefillRecord, pool: PagePool, handle: KVPoolHandle, states: StateSlots,
                    lend_until: float) -> KVTransfer:
    """The shared-path transfer of prefilled ``req``: its pages of the KV pool ``handle`` maps (and its state
    slot's handles), lent until ``lend_until`` (wall clock). The caller keeps the pages and the slot held."""
    return KVTransfer(rid=req.msg.rid, bootstrap_room=req.msg.bootstrap_room, cached_tokens=req.cached,
                      mrope_position_delta=req.mrope_delta, pool=handle, kv_pages=req.pages[:pool.pages_for(req.n)],
                      input_digest=req.msg.input_digest, lend_until=lend_until, state=states.shared_handoff(req.room),
                      **req.choice_fields())


def host_transfer(req: PrefillRecord, pool: PagePool, runner, states: StateSlots) -> KVTransfer:
    """The host-path transfer of prefilled ``req``: its prompt's KV ``[layers, 2, n, kv_heads, head_dim]`` (and
    its whole state) read out to host memory through ``runner``; the caller then releases its pages and slot."""
    slots = torch.tensor(pool.slots(req.pages, 0, req.n), dtype=torch.int64)
    return KVTransfer(rid=req.msg.rid, bootstrap_room=req.msg.bootstrap_room, cached_tokens=req.cached,
                      mrope_position_delta=req.mrope_delta, kv=runner.read_kv(slots), input_digest=req.msg.input_digest,
                      **req.choice_fields(),
                      state=states.host_handoff(req.room))


@dataclass
class EngineWrite:
    """A request's prompt KV being written into its decode server's pages by every TP rank's engine."""
    room: int
    started: float  # time.perf_counter() at the start
    waiting: set[int]  # TP ranks whose writes have not all ended
    nbytes: int = 0  # KV written by the ranks that ended
    state_bytes: int = 0  # ... and state (hybrid models)
    errors: list[str] = field(default_factory=list)


class EngineWriter:
    """Prefill rank 0's engine writes, each made by every TP rank of this server (its own :class:`RankWrites`,
    and ``TPEngineWrite`` to the other ranks, which answer ``TPEngineWriteDone``): a write is done when every rank
    reported its part ended, and failed when any part failed.

    Args:
        engine: rank 0's engine, its pool registered.
        runner: a ``ModelRunner`` (TP 1) or a ``TPRunner`` (``local`` is rank 0's runner; ``engine_write``,
            ``engine_cancel`` and ``write_reports`` reach the other ranks).
    """

    def __init__(self, engine: KVEngine, runner):
        local = getattr(runner, "local", runner)
        self.engine, self.runner, self.tp_size = engine, runner, local.tp.size
        self.rank = RankWrites.for_runner(engine, local)
        self._writes: dict[int, EngineWrite] = {}

    def start(self, req: PrefillRecord, src_slot: int = -1) -> EngineWrite | str:
        """Start writing prefilled ``req``'s prompt KV into the decode pages its registration names, and for a
        hybrid model its state slot ``src_slot`` (the final prompt state) into the decode slot it names, on every
        rank; an error message instead when rank 0 cannot (other pools, no decode slot, a dead peer): nothing
        was started then."""
        reg, started = req.reg, time.perf_counter()  # the write's time includes the engines' submits
        if err := self.rank.start(req.room, req.pages, req.n, reg.regions, reg.kv_pages, src_slot, reg.state_slot):
            return err
        if self.tp_size > 1:  # after the forward that computed the KV, in the ranks' call order
            self.runner.engine_write(TPEngineWrite(room=req.room, src_pages=list(req.pages), n_tokens=req.n,
                                                   regions=list(reg.regions), dst_pages=list(reg.kv_pages),
                                                   src_slot=src_slot, dst_slot=reg.state_slot))
        write = self._writes[req.room] = EngineWrite(req.room, started, set(range(self.tp_size)))
        return write

    def poll(self, write: EngineWrite) -> bool:
        """True once every rank's part of ``write`` (KV and state) has landed (it is then spent).

        Raises:
            KVEngineError: a rank's part failed; every part has ended (none can still land).
        """
        reports = [(0, *r) for r in self.rank.poll()]
        if self.tp_size > 1:
            reports += [(r.rank, r.room, r.nbytes, r.state_bytes, r.error) for r in self.runner.write_reports()]
        for rank, room, nbytes, state_bytes, error in reports:
            if (w := self._writes.get(room)) is not None:  # else: cancelled
                w.waiting.discard(rank)
                w.nbytes, w.state_bytes = w.nbytes + nbytes, w.state_bytes + state_bytes
                if error:
                    w.errors.append(f"TP rank {rank}: {error}" if self.tp_size > 1 else error)
        if write.waiting:
            return False
        del self._writes[write.room]
        if write.errors:
            raise KVEngineError("; ".join(write.errors))
        return True

    def cancel(self, write: EngineWrite) -> None:
        """Give up ``write`` on every rank (its request ended)."""
        self._writes.pop(write.room, None)
        self.rank.cancel(write.room)
        if self.tp_size > 1:
            self.runner.engine_cancel(write.room)


def engine_transfer(req: PrefillRecord, write: EngineWrite) -> KVTransfer:
    """The tensor-less transfer that tells decode ``req``'s KV is in its pages (after ``write`` completed)."""
    return KVTransfer(rid=req.msg.rid, bootstrap_room=req.msg.bootstrap_room, cached_tokens=req.cached,
                      mrope_position_delta=req.mrope_delta, input_digest=req.msg.input_digest, engine_written=True,
                      engine_bytes=write.nbytes, engine_state_bytes=write.state_bytes,
                      engine_seconds=time.perf_counter() - write.started,
                      **req.choice_fields())
