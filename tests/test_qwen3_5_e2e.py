"""Qwen3.5 (hybrid LM: Gated DeltaNet + gated attention) through the whole pipeline against transformers'
generate() on the same tiny checkpoint (issue 33).

Greedy output through `epdserve launch` must equal ``generate(do_sample=False)`` token for token: text, one photo,
two photos, a multi-turn chat, a prompt several times longer than ``--chunked-prefill-size``, a generated video
alone and after a photo; streaming and not. Five launches, each with small prefill chunks: the host KV path
(``--kv-transfer zmq``), the shared path (``--kv-transfer shared``: decode maps prefill's KV pool and state pool),
prefill and decode at TP=2 (gloo; DeltaNet heads split over the ranks), and the transfer engines (``--kv-transfer
nixl`` and ``mooncake``: prefill writes the KV pages and the state slot into decode's). A request's DeltaNet
state (conv + recurrent, every linear-attention layer) must cross the prefill -> decode boundary on each: a lost or
misplaced state would not match. A radix hit on a hybrid model restores the DeltaNet state snapshot taken at a
chunk end (a second request sharing the long prefix, the next turn of a chat) and still matches. An aborted stream
and a killed decode server leave every state slot and KV page back at baseline.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from cluster import at_baseline, body, details, serve_gateway, stream, wait_for
from conftest import hf_reference_model, launch_metrics_urls, launched
from test_e2e import CASES, NEW_TOKENS, _chat, _hf_reference, _openai_messages, _resolve, check_parity
from test_kv_engines import needs
from test_video_e2e import check_video_case

CHUNK = 32  # --prefill-chunked-prefill-size of every launch
PAGE = 16  # the default --page-size
_ITEMS = " ".join(f"Item {i} is a {c} box on the {s} shelf." for i, (c, s) in
                  enumerate(zip(["red", "green", "blue", "black"] * 4, ["top", "middle", "low", "left"] * 4)))
LONG = [("user", ["Read this slowly. " + _ITEMS])]
# Share LONG's text (another question after it; the next turn of its chat): radix hits on a state snapshot.
OTHER_QUESTION = [("user", ["Read this slowly. " + _ITEMS + " Which box is on the top shelf?"])]
NEXT_TURN = [*LONG, ("assistant", ["Sixteen boxes."]), ("user", ["Which one is black?"])]


@pytest.fixture(scope="module")
def hf35(tiny_qwen3_5_path):
    return hf_reference_model(tiny_qwen3_5_path, "Qwen3_5ForConditionalGeneration")


@pytest.fixture(scope="module")
def references(hf35, photo_paths):
    """Per case, transformers' ``(prompt ids, greedy ids, text)``, computed once for the module."""
    refs = {case: _hf_reference(hf35, _resolve(case, photo_paths), NEW_TOKENS) for case in CASES}
    refs["long"] = _hf_reference(hf35, LONG, NEW_TOKENS)
    refs["other_question"] = _hf_reference(hf35, OTHER_QUESTION, NEW_TOKENS)
    refs["next_turn"] = _hf_reference(hf35, NEXT_TURN, NEW_TOKENS)
    assert len(refs["long"][0]) > 4 * CHUNK
    assert refs["next_turn"][0][:len(refs["long"][0])] == refs["long"][0]
    return refs


LAUNCHES = {
    "zmq": ("--kv-transfer", "zmq", "--prefill-chunked-prefill-size", str(CHUNK)),
    "shared": ("--kv-transfer", "shared", "--prefill-chunked-prefill-size", str(CHUNK)),
    "tp2": ("--device", "cpu", "--prefill-tp", "2", "--decode-tp", "2", "--prefill-chunked-prefill-size",
            str(CHUNK)),
    # The transfer engines write each request's KV pages and its state slot into decode's (docs/architecture.md).
    "nixl": ("--kv-transfer", "nixl", "--prefill-chunked-prefill-size", str(CHUNK)),
    "mooncake": ("--kv-transfer", "mooncake", "--prefill-chunked-prefill-size", str(CHUNK)),
}
ENGINE_LAUNCHES = ("nixl", "mooncake")


@pytest.fixture(scope="module", params=[pytest.param(n, marks=needs(n)) if n in ENGINE_LAUNCHES else n
                                        for n in LAUNCHES])
def server35(request, tiny_qwen3_5_path, tmp_path_factory):
    with launched(tiny_qwen3_5_path, tmp_path_factory.mktemp(f"q35-{request.param}"),
                  *LAUNCHES[request.param]) as (url, log_path):
        yield request.param, url, log_path


def _at_rest(url: str) -> list[str]:
    """:func:`cluster.at_baseline` of the launch, and state pools present on both LM stages."""
    d = details(url)
    problems = at_baseline(d)
    for role in ("prefill", "decode"):
        load = d["stages"][role][0].get("load") or {}
        if not load.get("state_slots_total"):
            problems.append(f"{role}: no state slots reported ({load})")
    return problems


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(server35, references, tiny_qwen3_5_path, photo_paths, case):
    _, url, _ = server35
    check_parity(url, tiny_qwen3_5_path, _resolve(case, photo_paths), references[case])


@pytest.mark.parametrize("case", ["video", "video_photo"])
def test_video_parity_with_transformers(server35, hf35, tiny_qwen3_5_path, photo_paths, case):
    """A generated clip (timestamp text, one token run per temporal patch, as Qwen3-VL), alone and after a photo."""
    check_video_case(server35[1], tiny_qwen3_5_path, hf35, case, photo_paths["rocket"].read_bytes())


def _prefill_forwards(log_path) -> int:
    """Prefill forwards so far, from the prefill server's ``batch_size`` histogram count."""
    text = httpx.get(launch_metrics_urls(log_path)["prefill"], timeout=5).text
    return int(float(re.search(r"^epdserve:batch_size_count\{[^}]*\} (\S+)$", text, re.M).group(1)))


def test_long_prompt_in_chunks_then_radix_hits_on_state_snapshots(server35, references, tiny_qwen3_5_path):
    """A prompt over four chunks long is prefilled chunk by chunk (the state carried across chunks). Requests
    sharing its text then skip the prefix up to the longest DeltaNet state snapshot within it (taken at chunk ends
    and at the prompt's last page boundary) and still equal transformers: the same prompt again, another question
    after the same text, the next turn of the chat."""
    _, url, log_path = server35
    before = _prefill_forwards(log_path)
    n = len(references["long"][0])
    first = _chat(url, tiny_qwen3_5_path, _openai_messages(LONG))
    assert first["choices"][0]["token_ids"] == references["long"][1]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _prefill_forwards(log_path) - before >= math.ceil(n / CHUNK)  # chunk by chunk
    again = check_parity(url, tiny_qwen3_5_path, LONG, references["long"])  # and its stream, both hits
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE
    other = check_parity(url, tiny_qwen3_5_path, OTHER_QUESTION, references["other_question"])
    common = next(i for i, (a, b) in enumerate(zip(references["long"][0], references["other_question"][0]))
                  if a != b)
    hit = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert common // CHUNK * CHUNK <= hit <= common and hit > 0
    turn = check_parity(url, tiny_qwen3_5_path, NEXT_TURN, references["next_turn"])
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // PAGE * PAGE
    assert wait_for(lambda: not _at_rest(url), 20, 0.3), _at_rest(url)
    assert details(url)["stages"]["prefill"][0]["load"]["state_slots_cached"] > 0


def test_aborted_stream_returns_state_slots_and_pages(server35, references, tiny_qwen3_5_path):
    """A client that drops its stream after a few tokens: prefill and decode free the request's state slot and
    pages (details report them back at baseline), and the next request still equals transformers."""
    _, url, _ = server35
    req = body(tiny_qwen3_5_path, "Tell me a very long story about the sea.", max_tokens=2000, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=req, timeout=120) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break
    decode_load = details(url)["stages"]["decode"][0]["load"]
    assert decode_load["state_slots_total"] > 0
    assert wait_for(lambda: not _at_rest(url), 20, 0.3), _at_rest(url)
    ref_prompt, ref_ids, _ = references["text"]
    assert _chat(url, tiny_qwen3_5_path, _openai_messages(CASES["text"]))["choices"][0]["token_ids"] == ref_ids


def test_n2_greedy_forks_each_copy_the_state_and_equal_transformers(server35, references, tiny_qwen3_5_path,
                                                                      photo_paths):
    """n=2: one prefill, two decode forks sharing the prompt's KV pages, each with its own copy of the handed-off
    DeltaNet state; both equal transformers (on the tp2 launch through decode TP=2) and every slot comes back."""
    _, url, _ = server35
    ref_prompt, ref_ids, ref_text = references["one_photo"]
    resp = _chat(url, tiny_qwen3_5_path, _openai_messages(_resolve("one_photo", photo_paths)), n=2)
    assert [(c["index"], c["token_ids"], c["message"]["content"]) for c in resp["choices"]] == \
        [(0, ref_ids, ref_text), (1, ref_ids, ref_text)]
    assert resp["usage"]["completion_tokens"] == 2 * NEW_TOKENS
    assert wait_for(lambda: not _at_rest(url), 20, 0.3), _at_rest(url)


def test_shared_path_took_kv_and_state(server35):
    """Runs after the parity cases: on the shared launch every KV and state was copied out of prefill's mapped
    pools and acknowledged; no transfer was rejected."""
    name, _, log_path = server35
    log = log_path.read_text()
    assert "KV transfer has shape" not in log and "linear-attention state" not in log
    if name == "shared":
        assert "mapped a prefill KV pool (shm" in log
        assert log.count("KV copied by decode, pages released") >= len(CASES)


def test_state_bytes_counted_per_hand_off(server35, tiny_qwen3_5_path):
    """``state_transfer_bytes`` on both LM stages: every hand-off so far carried one whole request state (every
    DeltaNet layer's conv state in the model dtype and recurrent state in float32), sent and received alike. Through
    a transfer engine every one was written by it (``kv_engine_state_bytes``), none through host memory."""
    name, _, log_path = server35
    cfg = json.loads((Path(tiny_qwen3_5_path) / "config.json").read_text())["text_config"]
    layers = cfg["layer_types"].count("linear_attention")
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    per_request = layers * (conv_dim * cfg["linear_conv_kernel_dim"] * 4 + cfg["linear_num_value_heads"] *
                            cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4)  # CPU: float32 model
    urls = launch_metrics_urls(log_path)

    def value(role: str, name: str) -> float:
        text = httpx.get(urls[role], timeout=5).text
        return float(re.search(rf"^epdserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))

    handoffs = value("decode", "kv_transfer_latency_seconds_count")
    assert handoffs > 0
    assert value("decode", "state_transfer_bytes_total") == handoffs * per_request
    assert value("prefill", "state_transfer_bytes_total") == handoffs * per_request
    if name in ENGINE_LAUNCHES:
        assert value("decode", "kv_engine_state_bytes_total") == handoffs * per_request
        assert value("prefill", "kv_engine_state_bytes_total") == handoffs * per_request
        log = log_path.read_text()
        assert log.count("KV received (written by the engine") == handoffs and f"KV hand-off {name}" in log
        assert "through host memory" not in log and "KV write to the decode server failed" not in log


# ---------------------------------------------------------------------------------------------- killed decode


@pytest.fixture(scope="module")
def stages35(tiny_qwen3_5_path, tmp_path_factory):
    """Encoder, prefill and decode of the tiny Qwen3.5 as processes, sharing KV and state (decode maps prefill's
    pools), with a short request timeout so that lent pages and state slots come back soon after a decode dies."""
    from cluster import StageProcs

    # The request timeout is over decode's 5 s lend margin (decode/scheduler.py), else every shared copy expires.
    procs = StageProcs(tiny_qwen3_5_path, tmp_path_factory.mktemp("stages35"), request_timeout_s=8.0,
                       lm_args=("--kv-transfer", "shared"))
    procs.start()
    with serve_gateway(procs.gateway_config(stage_timeout_s=3.0)) as (base, _):
        yield procs, base
    procs.stop_all()


def test_killed_decode_returns_state_slots_and_pages(stages35, references, tiny_qwen3_5_path):
    procs, base = stages35
    streams, started = [], [threading.Event() for _ in range(4)]
    results = [None] * 4

    def run(i: int) -> None:
        results[i] = stream(base, body(tiny_qwen3_5_path, f"Stream {i}: go on and on.", max_tokens=400),
                            started[i], 60.0)

    for i in range(4):
        streams.append(threading.Thread(target=run, args=(i,)))
        streams[-1].start()
    assert all(e.wait(60) for e in started), "the streams did not all start"
    procs.kill("decode")
    for t in streams:
        t.join(60)
    assert all(r is not None and r.error is not None for r in results), [r and r.events[-2:] for r in results]

    def prefill_at_rest() -> bool:
        load = details(base)["stages"]["prefill"][0].get("load") or {}
        return load.get("state_slots_used") == 0 and load.get("kv_pages_used") == load.get("kv_pages_cached") \
            and load.get("state_slots_total", 0) > 0

    assert wait_for(prefill_at_rest, 20, 0.3), details(base)
    procs.start("decode")
    assert wait_for(lambda: not at_baseline(details(base)), 30, 0.3), at_baseline(details(base))
    time.sleep(0.5)
    for case in ("text", "long"):
        turns = LONG if case == "long" else CASES[case]
        resp = _chat(base, tiny_qwen3_5_path, _openai_messages(turns))
        assert resp["choices"][0]["token_ids"] == references[case][1], case
    assert wait_for(lambda: not at_baseline(details(base)), 20, 0.3), at_baseline(details(base))
