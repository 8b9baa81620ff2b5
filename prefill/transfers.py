"""The ``KVTransfer`` a prefilled request hands to its decode server, on any path: its prompt's attention KV and,
for hybrid models (Qwen3.5), its DeltaNet state (:class:`~epdserve.kvcache.state_slots.StateSlots`); on the
transfer engine path (:mod:`epdserve.kvcache.engine`) the write into the decode pages that comes before it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from epdserve.kvcache.engine import KVEngine, KVEngineError, check_region, page_copies
from epdserve.kvcache.page_pool import PagePool
from epdserve.kvcache.state_slots import StateSlots
from epdserve.prefill.records import PrefillRecord
from epdserve.wire.messages import KVPoolHandle, KVTransfer


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
    """A transfer engine's write of a request's prompt KV into its decode server's pages, in flight."""
    handle: object  # the engine's (KVEngine.submit)
    started: float  # time.perf_counter() at submit
    nbytes: int


def start_engine_write(engine: KVEngine, req: PrefillRecord, buffer: torch.Tensor) -> EngineWrite | str:
    """Start writing prefilled ``req``'s prompt KV out of the pool ``buffer`` into the decode pages its
    registration names; an error message (the write cannot happen: other pools, a dead peer) instead."""
    reg = req.reg
    err = check_region(reg.region, buffer, reg.kv_pages, req.n)
    if err:
        return err
    copies = page_copies(buffer, req.pages, reg.region, reg.kv_pages, req.n)
    started = time.perf_counter()  # before submit: posting thousands of writes is part of the write's cost
    try:
        return EngineWrite(engine.submit(reg.region, copies), started, sum(c[2] for c in copies))
    except KVEngineError as e:
        return str(e)


def engine_transfer(req: PrefillRecord, write: EngineWrite) -> KVTransfer:
    """The tensor-less transfer that tells decode ``req``'s KV is in its pages (after ``write`` completed)."""
    return KVTransfer(rid=req.msg.rid, bootstrap_room=req.msg.bootstrap_room, cached_tokens=req.cached,
                      mrope_position_delta=req.mrope_delta, input_digest=req.msg.input_digest, engine_written=True,
                      engine_bytes=write.nbytes, engine_seconds=time.perf_counter() - write.started,
                      **req.choice_fields())
