"""Two prefill and two decode servers behind one gateway, as `epdserve launch --num-prefills 2 --num-decodes 2`
starts them, with TP=2 (gloo) on prefill 0 and decode 0 (issue 48).

Greedy outputs equal transformers' ``generate()`` whichever servers a request lands on; a prompt sent again goes to
the prefill server that cached it (its response counts cached tokens); decode goes to the server with fewer requests
in flight. Last, a killed TP rank of decode 0 fails that server's request in flight with an error and takes the
server down, while the request on decode 1 runs on and new requests are served; every server left is back at rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

import httpx
import pytest
import torch
from cluster import at_baseline, details, wait_for
from conftest import launched
from test_e2e import _chat, _hf_reference, _openai_messages, _resolve, hf  # noqa: F401  (hf: a fixture)

NEW_TOKENS = 16
CASES = ["text", "one_photo", "two_photos"]
# Long enough (over 3 pages) that the chat template's shared first page is under the 0.3 cache threshold: each is
# a new prompt to the router, which puts it on the prefill server with the least cached.
FILLER = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def launch(tiny_model_path, tmp_path_factory):
    """(gateway URL, launch log) of the launch; Ctrl-C at the end must stop it with exit code 0."""
    with launched(tiny_model_path, tmp_path_factory.mktemp("multi"), "--device", "cpu", "--num-prefills", "2",
                  "--num-decodes", "2", "--prefill-tp", "2,1", "--decode-tp", "2,1") as out:
        yield out


@pytest.fixture(scope="module")
def references(hf, photo_paths):
    return {case: _hf_reference(hf, _resolve(case, photo_paths), NEW_TOKENS) for case in CASES}


def _placement(log_path: Path, rid: str) -> tuple[int, int]:
    """(prefill, decode) the gateway placed ``rid`` on, from its DEBUG log line."""
    assert wait_for(lambda: f"rid={rid} placed" in log_path.read_text(), 10), rid
    m = re.search(rf"rid={re.escape(rid)} placed on prefill (\d+) and decode (\d+)", log_path.read_text())
    return int(m.group(1)), int(m.group(2))


def _open_stream(stack: contextlib.ExitStack, url: str, model: str, text: str, max_tokens: int):
    """Start a greedy stream of ``text`` and read up to its first token; returns (response, rid, line iterator).
    Keep the iterator while the stream should stay open: collecting it closes the connection."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "stream": True,
            "max_completion_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}
    r = stack.enter_context(httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120))
    assert r.status_code == 200
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: ") and (event := json.loads(line[6:])).get("choices") and \
                event["choices"][0].get("token_ids"):
            return r, event["id"], lines
    pytest.fail("the stream ended before its first token")


def _decode_inflight(url: str) -> list[int]:
    return [s["inflight"] for s in details(url, fresh=False)["stages"]["decode"]]


def _check(url: str, model: str, photo_paths, references, case: str) -> dict:
    ref_prompt, ref_ids, ref_text = references[case]
    resp = _chat(url, model, _openai_messages(_resolve(case, photo_paths)), max_completion_tokens=NEW_TOKENS)
    assert resp["prompt_token_ids"] == ref_prompt
    assert resp["choices"][0]["token_ids"] == ref_ids, case
    assert resp["choices"][0]["message"]["content"] == ref_text
    return resp


def test_greedy_parity_on_both_decodes_and_repeats_go_where_cached(launch, references, tiny_model_path,
                                                                   photo_paths):
    """Two streams hold one decode server each; closing one sends the next requests to its server: each case on
    decode a, then each again on decode b, every one equal to transformers, the second time on the prefill server
    of the first and with its prefix cached there."""
    url, log = launch
    first, again, rids = {}, {}, {}
    with contextlib.ExitStack() as stack:
        s0, rid0, lines0 = _open_stream(stack, url, tiny_model_path, f"Hold zero. {FILLER}", 2000)
        s1, rid1, lines1 = _open_stream(stack, url, tiny_model_path, f"Hold one. {FILLER}", 2000)
        (_, a), (_, b) = _placement(log, rid0), _placement(log, rid1)
        assert {a, b} == {0, 1}  # the second went to the decode server without one in flight
        s0.close()
        assert wait_for(lambda: _decode_inflight(url)[a] == 0, 20)
        for case in CASES:  # decode a is free, b holds one: all go to a
            rids[case] = [_check(url, tiny_model_path, photo_paths, references, case)["id"]]
            first[case] = _placement(log, rids[case][0])
            assert first[case][1] == a, (case, first[case])
        s2, rid2, lines2 = _open_stream(stack, url, tiny_model_path, f"Hold two. {FILLER}", 2000)
        assert _placement(log, rid2)[1] == a
        s1.close()
        assert wait_for(lambda: _decode_inflight(url)[b] == 0, 20)
        for case in CASES:
            resp = _check(url, tiny_model_path, photo_paths, references, case)
            rids[case].append(resp["id"])
            again[case] = _placement(log, resp["id"])
            assert again[case] == (first[case][0], b), (case, first[case], again[case])
            assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (case, resp["usage"])
        placed = [*first.values(), *(_placement(log, r) for r in (rid0, rid1, rid2))]
        del lines0, lines1, lines2
    assert {p for p, _ in placed} == {0, 1}, placed  # new prompts spread over both prefill servers
    # The encoder pushed each image to TP rank 1 of prefill 0 (TP=2) when the request went there, never otherwise.
    assert any(first[case][0] == 0 for case in ("one_photo", "two_photos")), first
    text = log.read_text()
    for case, n_images in (("one_photo", 1), ("two_photos", 2)):
        for rid in rids[case]:
            got = re.findall(rf"rid={re.escape(rid)} TP rank 1 received the embedding of image (\w+)", text)
            assert len(got) == (n_images if first[case][0] == 0 else 0) == len(set(got)), (case, first[case], got)
    assert wait_for(lambda: not at_baseline(details(url)), 30), at_baseline(details(url))


def _follower_pid(zmq_addr: str) -> int:
    """The pid of TP rank 1 of the decode server whose requests socket is ``zmq_addr`` (its command line carries
    the server's flags)."""
    port = zmq_addr.rsplit(":", 1)[1]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"epdserve.engine.tp_follower" in argv and b"decode" in argv and \
                argv[argv.index(b"--zmq-port") + 1:][:1] == [port.encode()]:
            found.append(int(pid))
    assert len(found) == 1, found
    return found[0]


def test_killed_tp_rank_fails_its_server_only(launch, references, tiny_model_path, photo_paths):
    """A stream on each decode server; kill TP rank 1 of decode 0: its stream ends with an error event, decode 0
    goes down (the launch serves on), the stream on decode 1 goes on producing tokens, new requests are served
    (greedy outputs equal transformers'), and every server still up is back at rest."""
    url, log = launch
    _kill_decode0_rank1(url, log, tiny_model_path)
    for case in CASES:
        _check(url, tiny_model_path, photo_paths, references, case)
    assert wait_for(lambda: not [p for p in at_baseline(details(url)) if not p.startswith("decode0")], 30), \
        at_baseline(details(url))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_killed_tp_rank_on_cuda_fails_its_server_only(gpu_test_models, tmp_path_factory):
    """The same on two GPUs: decode 0 TP=2 on cuda:0,1 (NCCL, CUDA graphs, where rank 0 waits in a collective with
    the dead peer instead of raising), decode 1 on cuda:1. Its stream ends with an error event, decode 1 serves on,
    new requests are served, the servers left come back to rest, and Ctrl-C stops the launch with exit 0."""
    pytest.importorskip("flashinfer")
    model = gpu_test_models[0]
    with launched(model, tmp_path_factory.mktemp("multi-cuda"), "--device", "cuda", "--num-pages", "4096",
                  "--num-decodes", "2", "--decode-tp", "2,1", "--decode-gpus", "0,1") as (url, log):
        _kill_decode0_rank1(url, log, model)
        for i in range(3):
            resp = _chat(url, model, [{"role": "user", "content": f"Count to {i + 3}."}], max_completion_tokens=8)
            assert len(resp["choices"][0]["token_ids"]) == 8
        assert wait_for(lambda: not [p for p in at_baseline(details(url)) if not p.startswith("decode0")], 30), \
            at_baseline(details(url))


def _kill_decode0_rank1(url: str, log: Path, model: str) -> None:
    """Open a stream on each of the two decode servers, SIGKILL TP rank 1 of decode 0, and check: decode 0's
    stream ends with one error event and no finish, decode 1's goes on (20 more tokens), /health answers, decode 0
    is marked down and its rank 0 exited 1 with the launch serving on."""
    addr0 = details(url, fresh=False)["stages"]["decode"][0]["addr"]
    with contextlib.ExitStack() as stack:
        streams = {}
        for name in ("x", "y"):
            r, rid, lines = _open_stream(stack, url, model, f"Run {name}. {FILLER}", 3000)
            streams[_placement(log, rid)[1]] = (r, lines)
        assert sorted(streams) == [0, 1]
        os.kill(_follower_pid(addr0), signal.SIGKILL)
        events = [json.loads(line[6:]) for line in streams[0][1] if line.startswith("data: ") and line[6:] != "[DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and errors[0]["message"], events[-3:]
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))
        more = 0
        for line in streams[1][1]:  # decode 1's stream is untouched: it keeps producing tokens
            if line.startswith("data: ") and "error" not in (event := json.loads(line[6:])):
                more += len(event["choices"][0].get("token_ids") or [])
            assert "error" not in line
            if more >= 20:
                break
        assert more >= 20
    health = httpx.get(f"{url}/health", params={"details": 1}, timeout=5)
    assert health.status_code == 200
    assert wait_for(lambda: [s["up"] for s in details(url, fresh=False)["stages"]["decode"]] == [False, True], 20)
    # Its rank 0 failed what it held, exited 1, and the launcher left the others serving.
    assert wait_for(lambda: "decode0 (code 1) exited; the other servers of its role serve on" in log.read_text(), 20)
