"""``n > 1``: one prefill, ``n`` decode forks sharing the prompt's KV pages (decode/forks.py), ``n`` choices at the
gateway (epdserve/frontend/choices.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
import torch

from epdserve.decode.scheduler import DecodeScheduler
from epdserve.engine.model_runner import ModelRunner
from epdserve.prefill.scheduler import PrefillScheduler
from epdserve.wire.messages import DecodeRequest, KVRegister, PrefillRequest, SamplingParams

PAGE = 4


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=128,
                       page_size=PAGE)


def _prefilled(runner, ids, sampling, room):
    """The KVTransfer of prompt ``ids`` prefilled with ``sampling``."""
    sched = PrefillScheduler(runner, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0)
    sched.add_request(PrefillRequest(rid=f"r{room}", input_ids=ids, images=[], sampling=sampling,
                                     bootstrap_room=room))
    sched.register(KVRegister(rid=f"r{room}", bootstrap_room=room, kv_endpoint="tcp://d"))
    for _ in range(20):
        if sent := sched.step():
            (_, transfer), = sent
            assert transfer.error is None
            return transfer
    raise AssertionError("prefill never finished")


def _decode(dec, ids, sampling, room, transfer):
    dec.add_request(DecodeRequest(rid=f"r{room}", prompt_len=len(ids), sampling=sampling, bootstrap_host="h",
                                  bootstrap_port=1, bootstrap_room=room), peer=b"g")
    dec.add_transfer(transfer)


def test_decode_forks_share_prompt_pages_until_the_last_one_ends(runner):
    ids = list(range(100, 123))  # 23 tokens: 5 full pages shared, a partial last page copied per fork
    assert len(ids) % PAGE
    dec = DecodeScheduler(runner, context_length=4096, max_running_requests=8, timeout_s=60.0, kv_endpoint="tcp://me")
    one = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    _decode(dec, ids, one, 1, _prefilled(runner, ids, one, 1))
    want = [t for _ in range(12) for _, o in dec.step() for t in o.token_ids]
    assert len(want) == 8 and dec.pool.num_free == dec.pool.num_pages

    three = replace(one, n=3)
    transfer = _prefilled(runner, ids, three, 2)
    assert transfer.first_token_ids == [want[0]] * 3
    _decode(dec, ids, three, 2, transfer)
    outs = [o for _, o in dec.step()]
    forks = list(dec.running)
    assert [f.index for f in forks] == [0, 1, 2] and len({id(f.group) for f in forks}) == 1
    shared = list(forks[0].group.pages)
    assert len(shared) == len(ids) // PAGE and all(f.pages[:len(shared)] == shared for f in forks)
    own = [set(f.pages[len(shared):]) for f in forks]
    assert not (own[0] & own[1]) and not (own[1] & own[2]) and not (own[0] & own[2])
    # The whole request holds shared + 3 x own pages, not 3 x its pages.
    assert dec.pool.num_pages - dec.pool.num_free == len(shared) + sum(map(len, own))
    forks[1].max_out, forks[2].max_out = 3, 5  # the choices end at different steps
    ended = []
    for _ in range(12):
        for _, o in dec.step():
            outs.append(o)
            if o.finish_reason:
                ended.append(o.index)
                freed = set(dec.pool._free)
                # The prompt's shared pages stay held while any fork runs; a fork's own pages go with it.
                assert all((p in freed) == (len(ended) == 3) for p in shared)
                assert own[o.index] <= freed
                assert o.last == (len(ended) == 3)
    assert ended == [1, 2, 0] and dec.pool.num_free == dec.pool.num_pages and not dec.running
    got = {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}
    # Greedy: every fork decodes exactly what one sequence does, so each fork's copied partial page is right.
    assert got == {0: want, 1: want[:3], 2: want[:5]}
    assert [o.completion_tokens for o in outs if o.finish_reason] == [3, 5, 8]


def test_an_abort_frees_every_fork_and_seeded_choices_differ(runner):
    ids = list(range(200, 218))
    dec = DecodeScheduler(runner, context_length=4096, max_running_requests=8, timeout_s=60.0, kv_endpoint="tcp://me")
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7, n=4)
    runs = []
    for room in (1, 2):
        _decode(dec, ids, sampled, room, _prefilled(runner, ids, sampled, room))
        outs = [o for _ in range(16) for _, o in dec.step()]
        runs.append({i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(4)})
    assert runs[0] == runs[1]  # seed + i per choice: reproducible
    assert len({tuple(v) for v in runs[0].values()}) > 1 and all(len(v) == 12 for v in runs[0].values())
    _decode(dec, ids, sampled, 3, _prefilled(runner, ids, sampled, 3))
    dec.step()
    assert len(dec.running) == 4 and dec.pool.num_free < dec.pool.num_pages
    dec.abort("r3")
    assert not dec.running and dec.pool.num_free == dec.pool.num_pages
    # One choice's abort (its text hit a stop string at the front): its fork stops and gives its own pages back,
    # the others run on and the last of them still ends the request.
    _decode(dec, ids, sampled, 5, _prefilled(runner, ids, sampled, 5))
    dec.step()
    before = dec.pool.num_free
    fork2 = next(f for f in dec.running if f.index == 2)
    own = len(fork2.pages) - fork2.shared
    dec.abort("r5", 2)
    assert sorted(f.index for f in dec.running) == [0, 1, 3] and dec.pool.num_free == before + own
    outs = [o for _ in range(16) for _, o in dec.step()]
    assert all(o.index != 2 for o in outs) and [o.last for o in outs if o.finish_reason] == [False, False, True]
    assert not dec.running and dec.pool.num_free == dec.pool.num_pages
    # More choices than running slots can never be admitted: an error, not a request stuck in the queue.
    small = DecodeScheduler(runner, context_length=4096, max_running_requests=2, timeout_s=60.0,
                            kv_endpoint="tcp://me")
    _decode(small, ids, sampled, 4, _prefilled(runner, ids, sampled, 4))
    (_, out), = small.step()
    assert out.finish_reason == "error" and "max-running-requests" in out.error


# ---- end to end: `epdserve launch` (the session's ``server``: two encoders, the shared KV hand-off) --------------

@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from conftest import hf_reference_model

    return hf_reference_model(tiny_model_path)


def _by_choice(events: list) -> dict[int, dict]:
    """A chat stream's chunks reassembled per choice index: content, token ids, finish reasons, role chunks."""
    out: dict[int, dict] = {}
    for e in events:
        if not isinstance(e, dict):
            continue
        for c in e.get("choices") or []:
            got = out.setdefault(c["index"], {"content": "", "token_ids": [], "finish": [], "roles": 0})
            got["content"] += c["delta"].get("content") or ""
            got["token_ids"] += c.get("token_ids") or []
            got["roles"] += c["delta"].get("role") == "assistant"
            if c.get("finish_reason"):
                got["finish"].append(c["finish_reason"])
    return out


def test_n4_greedy_with_an_image_equals_transformers_stream_and_not(server, hf, tiny_model_path, photo_paths):
    from cluster import stream
    from test_e2e import NEW_TOKENS, PROMPT, _chat, _hf_reference, _openai_messages

    url, _ = server
    turns = [("user", [photo_paths["chelsea"], PROMPT])]
    ref_prompt, ref_ids, ref_text = _hf_reference(hf, turns)
    resp = _chat(url, tiny_model_path, _openai_messages(turns), n=4)
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    for c in resp["choices"]:
        assert c["token_ids"] == ref_ids and c["message"]["content"] == ref_text and c["finish_reason"] == "length"
    assert resp["prompt_token_ids"] == ref_prompt
    usage = resp["usage"]  # the prompt once, the choices' tokens summed
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ref_prompt), 4 * NEW_TOKENS)

    req = {"model": tiny_model_path, "messages": _openai_messages(turns), "temperature": 0, "n": 4,
           "max_completion_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True,
           "stream_options": {"include_usage": True}}
    result = stream(url, req)
    assert result.status == 200 and result.done and result.error is None
    choices = _by_choice(result.events)
    assert sorted(choices) == [0, 1, 2, 3]
    for got in choices.values():  # every choice streams its own role, text, ids and one finish
        assert (got["content"], got["token_ids"], got["finish"], got["roles"]) == (ref_text, ref_ids, ["length"], 1)
    (usage_event,) = [e for e in result.events if isinstance(e, dict) and e.get("usage")]
    assert usage_event["usage"]["completion_tokens"] == 4 * NEW_TOKENS


def test_n4_seeded_sampling_is_reproducible_and_choices_differ(server, tiny_model_path, photo_paths):
    from test_e2e import _openai_messages

    url, _ = server
    body = {"model": tiny_model_path, "n": 4, "temperature": 1.0, "seed": 1234, "max_completion_tokens": 24,
            "ignore_eos": True, "return_token_ids": True, "logprobs": True,
            "messages": _openai_messages([("user", [photo_paths["rocket"], "What is this?"])])}
    runs = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120) for _ in range(2)]
    assert all(r.status_code == 200 for r in runs), runs[0].text
    ids = [[c["token_ids"] for c in r.json()["choices"]] for r in runs]
    assert ids[0] == ids[1]  # choice i draws from seed + i: the same on every call
    assert len({tuple(t) for t in ids[0]}) > 1 and all(len(t) == 24 for t in ids[0])
    assert all(c["finish_reason"] == "length" for c in runs[0].json()["choices"])
    for c in runs[0].json()["choices"]:  # each choice's own logprobs, its prefill-sampled first token's included
        assert len(c["logprobs"]["content"]) == 24 and all(t["logprob"] <= 0 for t in c["logprobs"]["content"])


def test_n_on_completions_and_generate(server, tiny_model_path):
    url, _ = server
    prompt = "The rocket and the cat"
    one = httpx.post(f"{url}/v1/completions", json={"model": tiny_model_path, "prompt": prompt, "max_tokens": 12,
                                                     "temperature": 0, "return_token_ids": True}, timeout=120).json()
    many = httpx.post(f"{url}/v1/completions", json={"model": tiny_model_path, "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "return_token_ids": True, "n": 3},
                      timeout=120).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == one["choices"][0]["token_ids"] for c in many["choices"])
    assert many["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    gen = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "n": 2}}, timeout=120)
    assert gen.status_code == 200, gen.text
    bodies = gen.json()
    assert isinstance(bodies, list) and len(bodies) == 2
    assert all(b["output_ids"] == one["choices"][0]["token_ids"] for b in bodies)
    with httpx.stream("POST", f"{url}/generate", json={"text": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "n": 2}}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = {e["index"]: e["output_ids"] for e in events}
    assert last == {0: bodies[0]["output_ids"], 1: bodies[1]["output_ids"]}


def test_n3_json_schema_every_choice_validates(server, tiny_model_path):
    import jsonschema

    url, _ = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "tag": {"enum": ["a", "b", "c"]}},
              "required": ["ok", "level", "tag"], "additionalProperties": False}
    for temperature in (0, 1.0):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": tiny_model_path, "n": 3, "temperature": temperature, "seed": 5, "max_completion_tokens": 200,
            "messages": [{"role": "user", "content": "Give me JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, timeout=120)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3
        for c in choices:
            assert c["finish_reason"] == "stop", c
            jsonschema.validate(json.loads(c["message"]["content"]), schema)


def test_bad_n_gets_400_and_an_aborted_n4_stream_frees_everything(server, tiny_model_path):
    from cluster import at_baseline, details, wait_for

    url, _ = server
    msgs = [{"role": "user", "content": "Hello"}]
    for n, where in ((17, "--max-n"), (0, "n")):  # launch's default --max-n is 16
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": tiny_model_path, "messages": msgs, "n": n},
                       timeout=30)
        assert r.status_code == 400 and where in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/generate", json={"text": "Hi", "sampling_params": {"n": 99}}, timeout=30)
    assert r.status_code == 400 and "--max-n" in r.json()["error"]["message"]
    req = {"model": tiny_model_path, "messages": [{"role": "user", "content": "Tell me a very long story."}],
           "n": 4, "temperature": 1.0, "max_completion_tokens": 2000, "ignore_eos": True, "stream": True,
           "return_token_ids": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=req, timeout=120) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"] if c.get("token_ids")}
            if len(seen) == 4:
                break  # every fork is running: the client leaves
    assert wait_for(lambda: not at_baseline(details(url)), 20, 0.3), at_baseline(details(url))


def test_choices_demultiplex_cut_stop_strings_per_choice_and_sum_usage(tiny_model_path):
    from transformers import AutoTokenizer

    from epdserve.frontend.choices import Choices
    from epdserve.frontend.detokenizer import IncrementalDetokenizer, special_ids
    from epdserve.wire.messages import TokenOutput

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    first, rest0, rest1 = tok.encode(" red"), tok.encode(" blue sky"), tok.encode(" green sky")
    choices = Choices(2, lambda: IncrementalDetokenizer(tok, ["green"], special_ids(tok)))

    def out(i, token_ids, done=0, finish=None, last=True):
        return TokenOutput(rid="r", token_ids=token_ids, index=i, finish_reason=finish, completion_tokens=done,
                           last=last)

    text0, _ = choices.feed(out(0, first, len(first)))
    text1, _ = choices.feed(out(1, first, len(first)))
    assert text0 == text1 and not choices.done
    # Choice 1 hits the stop string: it ends here (cut before "green"), its fork's later tokens are dropped.
    text, final = choices.feed(out(1, rest1, len(first + rest1)))
    assert final.finish_reason == "stop" and "green" not in text1 + text and len(final.token_ids) < len(rest1) + 1
    assert choices.feed(out(1, first, 9, "length", last=False)) is None and not choices.done
    text, final0 = choices.feed(out(0, rest0, len(first + rest0), "length"))
    assert final0.finish_reason == "length" and text0 + text == " red blue sky" and choices.done
    assert choices.completion_tokens() == final.completion_tokens + len(first + rest0)
