"""The ``KVTransfer`` a prefilled request hands to its decode server, on either path: its prompt's attention KV and,
for hybrid models (Qwen3.5), its DeltaNet state (:class:`~epdserve.kvcache.state_slots.StateSlots`)."""

from __future__ import annotations

import torch

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
