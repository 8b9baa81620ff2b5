"""The schedulers' side of the transfer engine path, with a stand-in engine (no package needed, no processes):
every way a hand-off ends gives prefill's and decode's pages and rooms back.

- Prefill: a write that completes is followed by a tensor-less ``KVTransfer`` and the pages stay held until
  decode's ``KVAck``; a write that fails frees them and sends decode an error; an abort during a write gives the
  write up (the engine's ``cancel``) and frees them.
- Decode: the pages it reserves at arrival (named in its ``KVRegister``) come back on an error transfer and on its
  KV deadline; after an abort, once the write could no longer land in them (its transfer came, or the deadline);
  with too few free pages it registers without a region (host path).
- Both: an engine-written hand-off (a stand-in that really copies, both pools being in this process) decodes the
  same greedy tokens as the host path out of the pages decode reserved, and frees each of them once; a request of
  ``n > 1`` choices reserves its forks' pages too, the engine writes fork 0's and decode copies the partial last
  page to the other forks: every greedy fork decodes the same.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from epdserve.decode.scheduler import DecodeScheduler
from epdserve.engine.model_runner import ModelRunner
from epdserve.kvcache.engine import KVEngine, KVEngineError
from epdserve.prefill.scheduler import PrefillScheduler
from epdserve.wire.messages import DecodeRequest, KVAck, KVRegister, KVTransfer, PrefillRequest, SamplingParams
from test_schedulers import PAGE, _embeds, _req, _run, photo_request, runner  # noqa: F401  (fixtures)


class _StandIn(KVEngine):
    """Records writes; ``outcome`` says how each ends: done, fail (at its first poll) or never (still running)."""

    name = "nixl"

    def __init__(self, outcome: str = "done"):
        super().__init__()
        self.outcome, self.writes, self.cancelled = outcome, [], []

    def _register(self, buffer) -> None:
        pass

    def agent_name(self) -> str:
        return "stand-in"

    def submit(self, peer, copies):
        self.writes.append(copies)
        return len(self.writes)

    def poll(self, handle) -> bool:
        if self.outcome == "fail":
            raise KVEngineError("peer gone")
        return self.outcome == "done"

    def cancel(self, handle) -> None:
        self.cancelled.append(handle)


def _at_rest(load) -> bool:
    return load.rooms == 0 and load.kv_pages_used == load.kv_pages_cached and not load.num_running_reqs


@pytest.mark.parametrize("outcome", ["done", "fail", "abort"])
def test_prefill_engine_write_ends_with_pages_back(runner, photo_request, outcome):  # noqa: F811
    eng = _StandIn("never" if outcome == "abort" else outcome)
    eng.register(runner.kv_pool.buffer)
    sched = PrefillScheduler(runner, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0, engine=eng)
    n = len(photo_request[0])
    region = eng.describe()  # a decode pool of the same layout
    sched.register(KVRegister(rid="r", bootstrap_room=1, kv_endpoint="tcp://d", regions=[region],
                              kv_pages=list(range(-(-n // PAGE)))))
    sched.add_request(_req(photo_request, "r", 1, max_new_tokens=4))
    sched.add_embeddings(_embeds(photo_request, "r"))
    out = _run(sched, 5)
    assert len(eng.writes) == 1 and sum(c[2] for c in eng.writes[0]) == runner.kv_pool.bytes_per_page(
        num_layers=runner.kv_pool.num_layers, page_size=1, num_kv_heads=runner.kv_pool.num_kv_heads,
        head_dim=runner.kv_pool.head_dim, dtype=runner.kv_pool.dtype) * n  # the prompt's tokens, no more
    if outcome == "done":
        [(endpoint, t)] = out
        assert endpoint == "tcp://d" and t.engine_written and t.kv is None and t.error is None
        assert t.engine_bytes == sum(c[2] for c in eng.writes[0]) and t.first_token_id >= 0
        assert sched.load().rooms == 1  # lent until the ack
        sched.ack(KVAck(rid="r", bootstrap_room=1))
    elif outcome == "fail":
        [(_, t)] = out
        assert t.error and "peer gone" in t.error and not t.engine_written
    else:
        assert out == [] and sched.load().rooms == 1 and sched.has_work()  # the write is still running
        sched.abort("r")
        assert eng.cancelled == [1]
    assert _at_rest(sched.load()), sched.load()


def test_decode_reserved_pages_come_back(runner):  # noqa: F811
    eng = _StandIn()
    eng.register(runner.kv_pool.buffer)
    dec = DecodeScheduler(runner, context_length=4096, max_running_requests=8, timeout_s=60.0,
                          kv_endpoint="tcp://me", engine=eng)
    free = dec.pool.num_free

    def ask(rid, room, prompt_len=100, new=10):
        return dec.add_request(DecodeRequest(rid=rid, prompt_len=prompt_len, sampling=SamplingParams(
            max_new_tokens=new), bootstrap_host="h", bootstrap_port=1, bootstrap_room=room), peer=b"g")[1]

    reg = ask("a", 1)
    assert [r.agent for r in reg.regions] == ["stand-in"]
    assert len(reg.kv_pages) == dec.pool.pages_for(110) == free - dec.pool.num_free
    dec.abort("a")  # its pages stay held while a write into them may still be in flight ...
    assert dec.pool.num_free == free - len(reg.kv_pages) and dec.load().rooms == 0
    dec.engine_pages._held_back[1] = (time.monotonic() - 1, *dec.engine_pages._held_back[1][1:])
    dec.step()  # ... until the KV deadline
    assert dec.pool.num_free == free
    reg = ask("a2", 6)
    dec.abort("a2")
    dec.add_transfer(KVTransfer(rid="a2", bootstrap_room=6, engine_written=True))  # ... or its transfer comes
    assert dec.pool.num_free == free
    ask("b", 2)
    dec.add_transfer(KVTransfer(rid="b", bootstrap_room=2, error="prefill failed"))
    assert dec.pool.num_free == free and dec.outputs[-1][1].error == "prefill failed"
    ask("c", 3)
    dec.pending[3].deadline = time.monotonic() - 1
    out = dec.step()
    assert "timed out" in out[-1][1].error
    dec.engine_pages._held_back[3] = (time.monotonic() - 1, *dec.engine_pages._held_back[3][1:])
    dec.step()
    assert dec.pool.num_free == free
    # A request larger than the free pages registers without a region: its KV comes in the message.
    reg = ask("d", 4, prompt_len=10, new=free * PAGE)
    assert reg.regions == [] and reg.kv_pages == [] and dec.pool.num_free == free
    assert dec.load().rooms == 1
    dec.abort("d")
    assert dec.load().rooms == 0


class _Memmove(_StandIn):
    """A stand-in that really writes: both pools live in this process, so a write is a memmove."""

    def submit(self, peer, copies):
        for src, dst, nbytes in copies:
            ctypes.memmove(dst, src, nbytes)
        return super().submit(peer, copies)


def test_engine_written_kv_decodes_like_the_host_path_n2_forks_too(runner, tiny_model_path):  # noqa: F811
    drunner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=64,
                          page_size=PAGE)
    ids = list(range(100, 123))  # 23 tokens: 5 full pages and a partial last one
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

    def hand_off(prefill, dec, room, sampling):
        _, reg = dec.add_request(DecodeRequest(rid=f"r{room}", prompt_len=len(ids), sampling=sampling,
                                               bootstrap_host="h", bootstrap_port=1, bootstrap_room=room), peer=b"g")
        prefill.add_request(PrefillRequest(rid=f"r{room}", input_ids=ids, images=[], sampling=sampling,
                                           bootstrap_room=room))
        prefill.register(reg)
        (_, t), = _run(prefill, 5)
        dec.add_transfer(t)
        return reg, t

    def tokens(dec, n=1):
        outs = [o for _ in range(20) for _, o in dec.step()]
        assert [o.error for o in outs if o.finish_reason] == [None] * n
        return {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(n)}

    def scheds(engines):
        pe, de = engines or (None, None)
        return (PrefillScheduler(runner, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0, engine=pe),
                DecodeScheduler(drunner, context_length=4096, max_running_requests=8, timeout_s=60.0,
                                kv_endpoint="tcp://me", engine=de))

    prefill, dec = scheds(None)  # reference: the host path
    _, host_t = hand_off(prefill, dec, 1, greedy)
    want = tokens(dec)
    drunner.kv_pool.buffer.zero_()  # the engine path's pages are the same ones: only its write may fill them
    assert host_t.kv is not None and len(want[0]) == 8

    engines = _Memmove(), _Memmove()
    engines[0].register(runner.kv_pool.buffer)
    engines[1].register(drunner.kv_pool.buffer)
    prefill, dec = scheds(engines)
    free = dec.pool.num_free
    reg, t = hand_off(prefill, dec, 2, greedy)
    assert len(reg.regions) == 1 and t.engine_written and t.kv is None and t.error is None
    assert len(engines[0].writes) == 1 and not engines[1].writes
    outs = [o for _, o in dec.step()]  # admitted into the pages reserved at arrival
    [seq] = dec.running
    assert seq.pages == reg.kv_pages and seq.group.pages == reg.kv_pages[:len(ids) // PAGE]
    got = [tok for o in outs + [o for _ in range(20) for _, o in dec.step()] for tok in o.token_ids]
    assert got == want[0]
    assert dec.pool.num_free == free  # each reserved page freed once (a second free raises)
    (_, ack), = dec.take_acks()
    prefill.ack(ack)
    assert prefill.load().rooms == 0

    # n = 2: the shared prompt pages and both forks' own pages reserved; the engine writes fork 0's pages only.
    reg, t = hand_off(prefill, dec, 3, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, n=2))
    own = dec.pool.pages_for(len(ids) + 8) - len(ids) // PAGE
    assert len(reg.regions) == 1 and len(reg.kv_pages) == len(ids) // PAGE + 2 * own
    assert t.engine_written and t.kv is None and len(engines[0].writes) == 2
    assert tokens(dec, 2) == {0: want[0], 1: want[0]}
    (_, ack), = dec.take_acks()
    prefill.ack(ack)
    assert dec.pool.num_free == free and dec.load().rooms == 0 and prefill.load().rooms == 0
