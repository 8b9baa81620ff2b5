"""A hybrid model's (Qwen3.5) DeltaNet state through the transfer engines (``--kv-transfer nixl|mooncake``): each
rank's state pool is registered beside its KV pool, decode reserves a state slot at arrival and names it at
bootstrap, and prefill writes its heads of the request's slot into it in the same write as the KV pages
(epdserve/kvcache/state_copies.py).

- Through each engine, in one process: TP 2 -> 1, 1 -> 2 and 2 -> 2 state pool shards (conv channels q | k | v
  per rank, recurrent by value head) fill exactly the decode slot with every DeltaNet head, once, beside the KV
  pages, and no other slot; a region without a state slot, of other dtypes or heads the model lacks is refused.
- The schedulers with an engine stand-in that really copies (both pools in this process): the engine path's
  greedy tokens equal transformers' (chunked prefill, a radix hit on a state snapshot, n = 2 forks each copying
  the written state); the state bytes are counted; a registration without a slot falls back to the host path;
  decode's reserved slot (not zeroed: the write fills it) comes back on an error transfer, a wrong-sized state,
  its deadline, and after an abort once the write can no longer land; with no free slot decode registers without
  a region, and a request waiting for a slot lets a reserved one behind it pass.

- ``epdserve launch`` with prefill TP 1 -> decode TP 2 (Mooncake): greedy output equals transformers' (text, a
  photo, n = 2), every state crossed by the engine (``kv_engine_state_bytes_total``: one whole state per
  hand-off), none through host memory, and slots and pages are back at baseline.

The TP 1 launches (parity with transformers for text, photos, video and multi-turn through both engines, the state
bytes metric) are in tests/test_qwen3_5_e2e.py; a killed decode during a TP 2 hybrid hand-off in
tests/test_kv_engines.py.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import hf_reference_model, launch_metrics_urls, launched
from test_e2e import _chat, _hf_reference, _openai_messages, _resolve
from test_kv_engine_schedulers import _Memmove, _StandIn
from test_kv_engines import ENGINES, needs
from test_kv_engines_tp import _counter, check_engine_launch
from test_qwen3_5_schedulers import NEW, _at_rest, _dreq, _req, _runner, prompt, want, hf  # noqa: F401  (fixtures)
from test_schedulers import _decode_tokens, _run

from epdserve.decode.scheduler import DecodeScheduler
from epdserve.engine.distributed import TPGroup
from epdserve.engine.server import register_kv_engine
from epdserve.kvcache.engine import make_engine
from epdserve.kvcache.engine_copies import writer_heads
from epdserve.kvcache.rank_writes import RankWrites
from epdserve.kvcache.state_copies import check_state_region, describe_state, state_copies
from epdserve.models.qwen3_5_deltanet import deltanet_heads, deltanet_parts
from epdserve.prefill.scheduler import PrefillScheduler
from epdserve.wire.messages import KVTransfer, SamplingParams, decode, encode

# A model of 2 DeltaNet key heads (dim 3) and 4 value heads (dim 5), conv kernel 4, 3 DeltaNet layers; 2 KV heads.
CFG = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=3,
                      linear_value_head_dim=5, linear_conv_kernel_dim=4)
LAYERS, SLOTS, SRC_SLOT, DST_SLOT = 3, 3, 1, 2  # slots per pool (plus a scratch slot); the request's on each side
CONV_DIM = 2 * 2 * 3 + 4 * 5
KV_PAGES, PS, KV_D, N_TOKENS = 6, 2, 3, 7  # a small KV pool: the state goes in the same writes as its pages


def _shard(conv: torch.Tensor, rec: torch.Tensor, rank: int, size: int):
    """TP rank ``rank`` of ``size``'s state buffers cut from whole ones (the model's own channel split), and its
    first key and value heads."""
    tp = TPGroup(rank, size, torch.device("cpu"))
    rows, offset = [], 0
    for full, start, length in deltanet_parts(CFG, tp):
        rows.append(conv[:, :, offset + start:offset + start + length])
        offset += full
    k0, _, v0, hv = deltanet_heads(CFG, tp)
    return torch.cat(rows, dim=2).contiguous(), rec[:, :, v0:v0 + hv].contiguous(), k0, v0


def _side(size: int, conv: torch.Tensor, rec: torch.Tensor, kv: torch.Tensor, name: str):
    """One server of ``size`` TP ranks: per rank an engine with its KV head shard and state shard registered."""
    ranks = []
    for r in range(size):
        c, s, k0, v0 = _shard(conv, rec, r, size)
        h = 2 // size
        pool = kv[..., r * h:(r + 1) * h, :].contiguous()
        engine = make_engine(name, "127.0.0.1")
        engine.register(pool, head_start=r * h)
        engine.register_state(c, s, k0, v0)
        ranks.append(SimpleNamespace(engine=engine, kv=pool, conv=c, rec=s, rank=r))
    return ranks


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (2, 2)], ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"])
def test_state_writes_fill_the_decode_slot_with_every_head(name, layout):
    src_tp, dst_tp = layout
    conv = torch.randn(LAYERS, SLOTS + 1, CONV_DIM, 4)
    rec = torch.randn(LAYERS, SLOTS + 1, 4, 3, 5)
    kv = torch.randn(2, 2, KV_PAGES, PS, 2, KV_D)
    src = _side(src_tp, conv, rec, kv, name)
    dst = _side(dst_tp, torch.zeros_like(conv), torch.zeros_like(rec), torch.zeros_like(kv), name)
    try:
        writes = [RankWrites(p.engine, p.kv, p.rank * 2 // src_tp, writer_heads(4, 2, src_tp, p.rank), 2, (2, 4))
                  for p in src]
        for w in writes:
            assert w.start(7, [0, 1, 2, 3], N_TOKENS, [d.engine.describe() for d in dst], [5, 4, 3, 2],
                           SRC_SLOT, DST_SLOT) is None
        ended = []
        assert _poll_all(writes, [d.engine for d in dst], ended)
        assert all(err == "" for *_, err in ended), ended
        per_slot = LAYERS * (CONV_DIM * 4 + 4 * 3 * 5) * 4
        assert sum(state for _, _, state, _ in ended) == per_slot  # every head once
        want_conv, want_rec = torch.zeros_like(conv), torch.zeros_like(rec)
        want_conv[:, DST_SLOT], want_rec[:, DST_SLOT] = conv[:, SRC_SLOT], rec[:, SRC_SLOT]
        for d in dst:
            c, s, _, _ = _shard(want_conv, want_rec, d.rank, dst_tp)
            assert torch.equal(d.conv, c) and torch.equal(d.rec, s), d.rank  # that slot only, this rank's heads
        got_kv = torch.cat([d.kv for d in dst], dim=4)
        assert torch.equal(got_kv[:, :, 5], kv[:, :, 0]) and torch.equal(got_kv[:, :, 2, :1], kv[:, :, 3, :1])
    finally:
        for p in src + dst:
            p.engine.close()


def _poll_all(writes, targets, ended) -> bool:
    """Poll ``writes`` (the ``targets`` engines progressing meanwhile) until each has reported its room."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(ended) < len(writes):
        for t in targets:
            t.progress()
        ended.extend(r for w in writes for r in w.poll())
        time.sleep(0.001)
    return len(ended) == len(writes)


def test_state_regions_are_checked_and_equal_tp_moves_whole_runs():
    conv, rec = torch.zeros(LAYERS, SLOTS + 1, CONV_DIM, 4), torch.zeros(LAYERS, SLOTS + 1, 4, 3, 5)
    local = describe_state(conv, rec, 0, 0)
    peer = dataclasses.replace(local, conv_base=1 << 20, recurrent_base=1 << 24)
    assert check_state_region(peer, local, DST_SLOT, 2, 4) is None
    # Same heads on both sides: one conv run (q | k | v merged) and one recurrent run per layer.
    copies = state_copies(local, SRC_SLOT, peer, DST_SLOT)
    assert len(copies) == 2 * LAYERS and sum(c[2] for c in copies) == LAYERS * (CONV_DIM * 4 + 60) * 4
    assert "no linear-attention state slot" in check_state_region(None, local, DST_SLOT, 2, 4)
    assert "no linear-attention state slot" in check_state_region(peer, local, -1, 2, 4)
    assert "out of its pool" in check_state_region(peer, local, SLOTS, 2, 4)  # the scratch slot
    assert "dtypes" in check_state_region(dataclasses.replace(peer, recurrent_dtype="bfloat16"), local, 0, 2, 4)
    assert "shapes" in check_state_region(dataclasses.replace(peer, conv_shape=[LAYERS, 4, CONV_DIM, 3]), local, 0,
                                          2, 4)
    assert "not of the model's" in check_state_region(dataclasses.replace(peer, value_start=1), local, 0, 2, 4)
    assert "not of the model's" in check_state_region(peer, local, 0, 1, 4)


# ---------------------------------------------------------------------------------------------- the schedulers


def _per_request(runner) -> int:
    pool = runner.state_pool
    return pool.layers * (pool.conv_buffer[0, 0].numel() * pool.conv_buffer.element_size()
                          + pool.recurrent_buffer[0, 0].numel() * pool.recurrent_buffer.element_size())


def _engines(pre_runner, dec_runner):
    engines = _Memmove(), _Memmove()
    register_kv_engine(engines[0], pre_runner)
    register_kv_engine(engines[1], dec_runner)
    return engines


def _dec(runner, engine, **kw) -> DecodeScheduler:
    return DecodeScheduler(runner, context_length=4096, max_running_requests=8, timeout_s=kw.get("timeout_s", 60.0),
                           kv_endpoint="tcp://me", engine=engine)


def test_engine_written_state_equals_transformers_radix_hit_and_forks_too(tiny_qwen3_5_path, prompt, want):  # noqa: F811
    pre_runner = _runner(tiny_qwen3_5_path, num_state_slots=2 + 1)
    dec_runner = _runner(tiny_qwen3_5_path, num_state_slots=3)
    engines = _engines(pre_runner, dec_runner)
    prefill = PrefillScheduler(pre_runner, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0,
                               chunked_prefill_size=16, state_snapshot_slots=1, engine=engines[0])
    dec = _dec(dec_runner, engines[1])
    per_request = _per_request(dec_runner)
    for room, n in ((1, 1), (2, 1), (3, 2)):  # room 2: a radix hit on room 1's snapshot; room 3: two forks
        dreq, preq = _dreq(prompt, room), _req(prompt, room)
        dreq.sampling = preq.sampling = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, n=n)
        _, reg = dec.add_request(dreq, peer=b"g")
        assert reg.state_slot >= 0 and reg.regions[0].state is not None and dec.load().state_slots_used == 1
        prefill.add_request(preq)
        prefill.register(reg)
        (_, t), = _run(prefill, 20)
        assert t.engine_written and t.state is None and t.error is None and t.engine_state_bytes == per_request
        assert (t.cached_tokens > 0) == (room > 1)
        dec.add_transfer(decode(encode(t)))  # through the wire codec, as between processes
        outs = [o for _ in range(NEW + 4) for _, o in dec.step()]
        assert [o.error for o in outs if o.finish_reason] == [None] * n
        assert [[tok for o in outs if o.index == i for tok in o.token_ids] for i in range(n)] == [want] * n, room
        assert dec.metrics.kv_engine_state_bytes._value.get() == room * per_request
        for _, ack in dec.take_acks():
            prefill.ack(ack)
        assert _at_rest(prefill) and _at_rest(dec) and dec.load().rooms == 0
    # A registration without a state slot cannot take the engine's write: the host path carries the state.
    _, reg = dec.add_request(_dreq(prompt, 4), peer=b"g")
    prefill.add_request(_req(prompt, 4))
    prefill.register(dataclasses.replace(reg, state_slot=-1))
    (_, t), = _run(prefill, 20)
    assert not t.engine_written and t.state.conv is not None and t.kv is not None
    dec.add_transfer(t)
    got, last = _decode_tokens(dec, 4)
    assert got == want and _at_rest(prefill) and _at_rest(dec)


def test_decode_reserved_state_slots_come_back(tiny_qwen3_5_path, prompt):  # noqa: F811
    dec_runner = _runner(tiny_qwen3_5_path, num_state_slots=2)
    eng = _StandIn()
    register_kv_engine(eng, dec_runner)
    dec = _dec(dec_runner, eng)
    free = dec.pool.num_free

    def ask(room):
        return dec.add_request(_dreq(prompt, room), peer=b"g")[1]

    def held():
        return dec.load().state_slots_used

    dec_runner.state_pool.conv_buffer.fill_(1.0)
    a, b = ask(1), ask(2)
    assert {a.state_slot, b.state_slot} == {0, 1} and held() == 2
    # Not zeroed: the engines write it whole, and on CUDA a queued zeroing could land after their write.
    assert bool(dec_runner.state_pool.conv_buffer[:, a.state_slot].eq(1.0).all())
    c = ask(3)  # no slot left: registered without a region (host path), no pages held for it
    assert c.regions == [] and c.kv_pages == [] and c.state_slot == -1 and held() == 2
    dec.abort("r3")
    dec.abort("r1")  # its slot stays held while a write into it may still be in flight ...
    assert held() == 2 and dec.load().rooms == 1
    dec.add_transfer(KVTransfer(rid="r1", bootstrap_room=1, engine_written=True))  # ... until its transfer comes
    assert held() == 1
    dec.add_transfer(KVTransfer(rid="r2", bootstrap_room=2, error="prefill failed"))
    assert held() == 0 and dec.pool.num_free == free
    ask(4)
    dec.add_transfer(KVTransfer(rid="r4", bootstrap_room=4, first_token_id=1, engine_written=True,
                                engine_state_bytes=_per_request(dec_runner) - 4))  # not one whole state
    assert "bytes of linear-attention state" in dec.outputs[-1][1].error and held() == 0
    ask(5)
    dec.pending[5].deadline = time.monotonic() - 1
    assert "timed out" in dec.step()[-1][1].error and held() == 1  # held back: a write may still land
    dec.engine_pages._held_back[5] = (time.monotonic() - 1, *dec.engine_pages._held_back[5][1:])
    dec.step()
    assert held() == 0 and dec.pool.num_free == free and dec.load().rooms == 0


def test_a_request_waiting_for_a_slot_lets_a_reserved_one_pass(tiny_qwen3_5_path, prompt, want):  # noqa: F811
    """Decode's one state slot is reserved by request 1 at arrival, so request 2 registers for the host path; 2's KV
    comes first and waits for a slot that only 1's run gives back: 1 (everything reserved) passes it, both finish
    equal to transformers and everything comes back."""
    pre_runner = _runner(tiny_qwen3_5_path, num_state_slots=2)
    dec_runner = _runner(tiny_qwen3_5_path, num_state_slots=1)
    engines = _engines(pre_runner, dec_runner)
    prefill = PrefillScheduler(pre_runner, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0,
                               engine=engines[0])
    dec = _dec(dec_runner, engines[1])
    regs = [dec.add_request(_dreq(prompt, room), peer=b"g")[1] for room in (1, 2)]
    assert regs[0].state_slot == 0 and regs[1].regions == [] and regs[1].state_slot == -1
    for room in (2, 1):  # request 2's KV first
        prefill.add_request(_req(prompt, room))
        prefill.register(regs[room - 1])
        (_, t), = _run(prefill, 20)
        dec.add_transfer(t)
        assert t.engine_written == (room == 1)
        if room == 2:
            dec.step()
            assert not dec.running and len(dec.ready) == 1  # waits for request 1's slot
    outs = [o for _ in range(3 * NEW) for _, o in dec.step()]
    assert {o.rid: o.finish_reason for o in outs if o.finish_reason} == {"r1": "length", "r2": "length"}
    assert [tok for o in outs if o.rid == "r2" for tok in o.token_ids] == want
    for _, ack in dec.take_acks():
        prefill.ack(ack)
    assert _at_rest(prefill) and _at_rest(dec) and dec.load().rooms == 0


@needs("mooncake")
def test_launch_tp1_to_tp2_through_mooncake_equals_transformers(tiny_qwen3_5_path, photo_paths, tmp_path_factory):
    hf = hf_reference_model(tiny_qwen3_5_path, "Qwen3_5ForConditionalGeneration")
    refs = {case: _hf_reference(hf, _resolve(case, photo_paths)) for case in ("text", "one_photo")}
    with launched(tiny_qwen3_5_path, tmp_path_factory.mktemp("q35-mooncake-tp"), "--kv-transfer", "mooncake",
                  "--decode-tp", "2") as (url, log_path):
        for case, (ref_prompt, ref_ids, _) in refs.items():
            resp = _chat(url, tiny_qwen3_5_path, _openai_messages(_resolve(case, photo_paths)), n=2)
            assert resp["prompt_token_ids"] == ref_prompt, case
            assert [c["token_ids"] for c in resp["choices"]] == [ref_ids] * 2, case
        per_request = 3 * (256 * 4 + 4 * 32 * 32) * 4  # the tiny model: 3 DeltaNet layers, float32 on the CPU
        decode_metrics = launch_metrics_urls(log_path)["decode"]
        assert _counter(decode_metrics, "epdserve:kv_engine_state_bytes_total") == len(refs) * per_request
        check_engine_launch(url, log_path, len(refs))
