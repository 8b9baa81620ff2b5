"""Prefill and decode schedulers of a hybrid model (tiny Qwen3.5) driven directly (no sockets), issue 33: a state
slot per request from admission to the release of its pages; the state crosses to decode on the host path (tensors
in the ``KVTransfer``) and the shared path (decode copies the slot out of prefill's mapped state pool, which
prefill holds until the ``KVAck`` or its deadline); greedy tokens equal transformers' generate(); radix hits only
as far as a state snapshot reaches (none without snapshot slots); slots come back on finish, abort and deadline;
a transfer without a (well-shaped) state is refused."""

from __future__ import annotations


import pytest
import torch

from epdserve.engine.model_runner import ModelRunner
from epdserve.kvcache.kv_share import host_id
from epdserve.prefill.scheduler import PrefillScheduler
from epdserve.wire.messages import DecodeRequest, KVRegister, PrefillRequest, SamplingParams, decode, encode
from epdserve.wire.messages import StateHandoff
from test_schedulers import _decode_sched, _decode_tokens, _fake_clock, _run

PAGE = 4
NEW = 6


@pytest.fixture(scope="module")
def prompt(tiny_qwen3_5_path) -> list[int]:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_qwen3_5_path)
    text = proc.apply_chat_template([{"role": "user", "content": "Tell me a long story about the sea. " * 3}],
                                    add_generation_prompt=True, tokenize=False)
    return proc.tokenizer(text)["input_ids"]


@pytest.fixture(scope="module")
def hf(tiny_qwen3_5_path):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32).eval()


def _generate(hf, ids: list[int]) -> list[int]:
    """transformers' greedy tokens (the first one is prefill's)."""
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def want(hf, prompt) -> list[int]:
    return _generate(hf, prompt)


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(path, device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=PAGE,
                       attention_backend="sdpa", **kw)


@pytest.fixture(scope="module")
def runners(tiny_qwen3_5_path):
    """(prefill runner with 2 state slots and shared pools, decode runner with 4 slots)."""
    return (_runner(tiny_qwen3_5_path, num_state_slots=2, share_kv=True),
            _runner(tiny_qwen3_5_path, num_state_slots=4))


def _prefill(runner, **kw) -> PrefillScheduler:
    return PrefillScheduler(runner, context_length=4096, max_prefill_tokens=8192, timeout_s=kw.get("timeout_s", 60.0),
                            chunked_prefill_size=kw.get("chunk", 0), state_snapshot_slots=kw.get("snapshots", 0))


def _req(prompt, room) -> PrefillRequest:
    return PrefillRequest(rid=f"r{room}", input_ids=prompt, images=[],
                          sampling=SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True),
                          bootstrap_room=room)


def _dreq(prompt, room) -> DecodeRequest:
    return DecodeRequest(rid=f"r{room}", prompt_len=len(prompt), bootstrap_host="h", bootstrap_port=1,
                         sampling=SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True),
                         bootstrap_room=room)


def _at_rest(sched) -> bool:
    load = sched.load()
    return load.state_slots_used == 0 and load.kv_pages_used == load.kv_pages_cached and \
        sched.runner.state_pool.num_used == load.state_slots_cached


def test_host_and_shared_hand_off_equal_transformers(runners, prompt, want):
    pre_runner, dec_runner = runners
    prefill = _prefill(pre_runner, chunk=16)  # chunked: the state carried across chunks
    assert prefill.load().state_slots_total == 2
    for room, shared in ((1, False), (2, True), (3, True)):
        dec = _decode_sched(dec_runner, accept_shared=shared)
        _, reg = dec.add_request(_dreq(prompt, room), peer=b"g")
        prefill.add_request(_req(prompt, room))
        prefill.register(reg)
        (_, t), = _run(prefill, 10)
        if shared:
            assert t.kv is None and t.state.conv is None and t.state.slot >= 0
            assert prefill.load().state_slots_used == 1  # lent with the pages until the ack
        else:
            assert t.state.conv.shape == (3, 256, 4) and t.state.recurrent.shape == (3, 4, 32, 32)
            assert _at_rest(prefill)
        dec.add_transfer(decode(encode(t)))  # through the wire codec, as between processes
        got, last = _decode_tokens(dec, room)
        # The same prompt again: no radix hit without state snapshots (a hit would lack the DeltaNet state).
        assert got == want and last.finish_reason == "length" and last.cached_tokens == 0
        assert _at_rest(dec)
        for _, ack in dec.take_acks():
            prefill.ack(ack)
        assert _at_rest(prefill) and prefill.load().state_slots_cached == 0


def test_slots_bound_admission_and_come_back_on_abort_and_deadline(runners, prompt, monkeypatch):
    import epdserve.prefill.scheduler as prefill_scheduler

    pre_runner, _ = runners
    clock = _fake_clock(monkeypatch, prefill_scheduler)
    prefill = _prefill(pre_runner, chunk=8, timeout_s=0.5)
    for room in (1, 2, 3):
        prefill.add_request(_req(prompt, room))
    prefill.step()
    load = prefill.load()
    assert (load.num_running_reqs, load.num_waiting_reqs, load.state_slots_used) == (2, 1, 2)  # 2 slots only
    prefill.abort("r1")  # mid chunked prefill: its slot goes to the third request
    prefill.step()
    assert prefill.load().num_running_reqs == 2 and prefill.load().state_slots_used == 2
    # Room 2 is lent to a decode server (shared path) that never acks, room 3 waits for a registration that never
    # comes: both give their slots and pages back at the deadline.
    prefill.register(KVRegister(rid="r2", bootstrap_room=2, kv_endpoint="tcp://d:1", host_id=host_id(),
                                accept_shared=True))
    (_, lent), = _run(prefill, 20)
    assert lent.bootstrap_room == 2 and lent.state.slot >= 0 and prefill.load().num_running_reqs == 0
    assert prefill.load().state_slots_used == 2
    clock.advance(0.6)
    prefill.step()
    assert _at_rest(prefill) and not prefill.reqs


def test_decode_refuses_transfers_without_a_well_shaped_state(runners, prompt):
    pre_runner, dec_runner = runners
    prefill = _prefill(pre_runner)
    for room, state, words in ((7, None, "lacks the linear-attention state"),
                               (8, StateHandoff(conv=torch.zeros(3, 256, 3), recurrent=torch.zeros(3, 4, 32, 32)),
                                "linear-attention state has shapes")):
        dec = _decode_sched(dec_runner)
        _, reg = dec.add_request(_dreq(prompt, room), peer=b"g")
        prefill.add_request(_req(prompt, room))
        prefill.register(reg)
        (_, t), = _run(prefill, 10)
        t.state = state
        dec.add_transfer(t)
        _, last = _decode_tokens(dec, room)
        assert last.finish_reason == "error" and words in last.error
        assert _at_rest(dec)


def test_radix_hit_restores_the_state_snapshot_and_equals_transformers(tiny_qwen3_5_path, runners, hf):
    """Snapshots at chunk ends: a request sharing a long prefix with an earlier one (another question after the same
    text; the next turn of the same chat) skips the prefix up to the longest snapshot within it and still equals
    transformers token for token."""
    from transformers import AutoProcessor

    _, dec_runner = runners
    proc = AutoProcessor.from_pretrained(tiny_qwen3_5_path)
    shared = "Here is a long note. " + " ".join(f"Line {i} says the {c} lamp is on." for i, c in
                                               enumerate(["red", "blue", "green"] * 2))

    def ids(turns):
        text = proc.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return proc.tokenizer(text)["input_ids"]

    first = [{"role": "user", "content": shared + " What is on?"}]
    prompts = [ids(first), ids([{"role": "user", "content": shared + " Which lamp is off?"}]),
               ids(first + [{"role": "assistant", "content": "The red lamp."},
                            {"role": "user", "content": "And the blue one?"}])]
    runner = _runner(tiny_qwen3_5_path, num_state_slots=2 + 4)
    prefill = _prefill(runner, chunk=16, snapshots=4)
    cached = []
    for room, p in enumerate(prompts, 1):
        dec = _decode_sched(dec_runner)
        _, reg = dec.add_request(_dreq(p, room), peer=b"g")
        prefill.add_request(_req(p, room))
        prefill.register(reg)
        (_, t), = _run(prefill, 20)
        dec.add_transfer(t)
        got, last = _decode_tokens(dec, room)
        assert got == _generate(hf, p), (room, last)
        cached.append(last.cached_tokens)
        assert _at_rest(prefill) and _at_rest(dec)
    common = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    assert prompts[2][:len(prompts[0])] == prompts[0]  # the next turn extends the first prompt
    # Snapshots at every 16 tokens and at the first prompt's last page boundary (PAGE 4).
    assert cached == [0, common // 16 * 16, (len(prompts[0]) - 1) // PAGE * PAGE]
    assert cached[1] >= 32 and prefill.load().state_slots_cached == 4  # LRU: the capacity is full


def test_a_hit_takes_the_snapshot_slot_itself_when_the_pool_is_full(tiny_qwen3_5_path, runners, hf, prompt):
    """Two state slots: one taken by a request admitted just before, the other held by the one snapshot. A request
    hitting that snapshot gets its slot itself (no copy, the snapshot is gone) and still equals transformers;
    with the pool full, newer snapshots replace older ones."""
    _, dec_runner = runners
    runner = _runner(tiny_qwen3_5_path, num_state_slots=2)
    prefill = _prefill(runner, chunk=16, snapshots=1)
    longer = prompt + prompt[-6:]  # extends ``prompt``: hits its snapshot at its last page boundary

    def finish(room, ids, steps):
        dec = _decode_sched(dec_runner)
        _, reg = dec.add_request(_dreq(ids, room), peer=b"g")
        prefill.register(reg)
        for _, t in _run(prefill, steps):
            dec.add_transfer(t)
        return _decode_tokens(dec, room)

    prefill.add_request(_req(prompt, 1))
    finish(1, prompt, 20)
    assert prefill.load().state_slots_cached == 1  # the newest (the last page boundary) replaced the older ones
    prefill.add_request(_req(prompt[::-1], 2))  # admitted first: takes the free slot (no hit: another prefix)
    prefill.add_request(_req(longer, 3))
    got, last = finish(3, longer, 2)  # two chunks: up to its own last page boundary, then the rest
    assert last.cached_tokens == (len(prompt) - 1) // PAGE * PAGE and got == _generate(hf, longer)
    load = prefill.load()
    assert load.state_slots_used == 1 and load.num_running_reqs == 1  # request 2 still runs, 3 gave its slot back
    finish(2, prompt[::-1], 40)
    assert _at_rest(prefill)
