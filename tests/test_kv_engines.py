"""KV hand-off through a transfer engine (``--kv-transfer nixl|mooncake``, epdserve/kvcache/engine.py).

- Both engines write pages of one pool into pages of another (in one process, two engines) as
  :func:`page_copies` says, and nothing else.
- ``epdserve launch --kv-transfer <engine>``: greedy output equals transformers' generate() (text, a photo, two
  photos, two turns; streaming and not), and every request's KV went the engine's way.
- Killing decode while it holds a request whose KV is being handed over fails that request cleanly; prefill's and
  decode's pages, state slots, rooms and registrations return to baseline (/health?details=1). NIXL's cases run TP
  2 on both servers (every rank's write fails), one of them with Qwen3.5 (the state slot written beside the KV);
  Mooncake's TP 1.

Different TP sizes on the two sides: tests/test_kv_engines_tp.py. A hybrid model's (Qwen3.5) state through the
engines: tests/test_kv_engines_hybrid.py, and its launches in tests/test_qwen3_5_e2e.py. Each engine's tests skip when its package
(``epdserve[nixl]``, ``epdserve[mooncake]``) does not import.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import threading

import pytest
import torch

from cluster import StageProcs, at_baseline, body, details, noise_png, serve_gateway, stage, stream, wait_for
from conftest import hf_reference_model, launched
from test_e2e import CASES, NEW_TOKENS, _chat, _hf_reference, _openai_messages, _resolve

from epdserve.kvcache.engine import KV_ENGINES, KVEngineError, make_engine
from epdserve.kvcache.engine_copies import check_region, page_copies


def _import_error(name: str) -> str | None:
    """Why engine ``name``'s package does not import here (None when it does): not installed, or, for Mooncake's
    non-CUDA build, the system's libibverbs.so.1 missing (Debian/Ubuntu: apt-get install libibverbs1)."""
    try:
        importlib.import_module(KV_ENGINES[name][0])
        return None
    except ImportError as e:
        return f"epdserve[{name}] does not import: {e}"


def _importable(name: str) -> bool:
    return _import_error(name) is None


def needs(name: str):
    """Skip unless engine ``name``'s package imports here."""
    return pytest.mark.skipif(not _importable(name), reason=str(_import_error(name)))


ENGINES = [pytest.param(n, marks=needs(n)) for n in KV_ENGINES]


@pytest.mark.parametrize("name", ENGINES)
def test_engine_writes_exactly_the_named_pages(name):
    src = torch.randn(2, 2, 8, 4, 2, 3)  # [L, 2, pages, page_size, H, D]
    dst = torch.zeros(2, 2, 6, 4, 2, 3)
    a, b = make_engine(name, "127.0.0.1"), make_engine(name, "127.0.0.1")
    try:
        a.register(src)
        b.register(dst)
        region = b.describe()
        src_pages, dst_pages = [2, 3, 7], [4, 5, 1]  # 2, 3 -> 4, 5 is one run of two pages
        assert check_region(region, src, dst_pages, 10, 2) is None
        copies = page_copies(src, src_pages, region, dst_pages, 10)
        assert len(copies) == 2 * 2 * 2  # (K, V) x layers x runs
        handle = a.submit(region, copies)
        assert wait_for(lambda: b.progress() or a.poll(handle), 10, 0.001)  # b: as a decode loop turn does
        want = torch.zeros_like(dst)
        want[:, :, [4, 5]] = src[:, :, [2, 3]]
        want[:, :, 1, :2] = src[:, :, 7, :2]  # 10 tokens: the last page only as far as the prompt goes
        assert torch.equal(dst, want)
        # Another layout, too few pages, or pages outside the peer pool are refused before any write.
        assert "shape" in check_region(region, torch.zeros(2, 2, 8, 3, 2, 3), dst_pages, 10, 2)
        assert "pages" in check_region(region, src, [4, 5], 10, 2)
        assert "pages" in check_region(region, src, [4, 5, 6], 10, 2)
        # A region holding KV heads the model does not have (another model, a forged registration) is refused too.
        assert "KV heads" in check_region(dataclasses.replace(region, head_start=1), src, dst_pages, 10, 2)
    finally:
        a.close()
        b.close()


def test_unknown_or_missing_engine_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown KV transfer engine"):
        make_engine("rdma", "127.0.0.1")
    monkeypatch.setitem(KV_ENGINES, "nixl", ("epdserve.kvcache.no_such_module", "X", KV_ENGINES["nixl"][2]))
    with pytest.raises(KVEngineError, match=re.escape("pip install 'epdserve[nixl]'")):
        make_engine("nixl", "127.0.0.1")


@pytest.fixture(scope="module", params=ENGINES)
def engine_server(request, tiny_model_path, tmp_path_factory):
    with launched(tiny_model_path, tmp_path_factory.mktemp(f"launch-{request.param}"),
                  "--kv-transfer", request.param) as (url, log_path):
        yield request.param, url, log_path


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return hf_reference_model(tiny_model_path)


def test_greedy_parity_through_the_engine(engine_server, hf, tiny_model_path, photo_paths):
    name, url, log_path = engine_server
    for case in CASES:
        turns = _resolve(case, photo_paths)
        ref_prompt, ref_ids, ref_text = _hf_reference(hf, turns)
        resp = _chat(url, tiny_model_path, _openai_messages(turns))
        assert resp["prompt_token_ids"] == ref_prompt, case
        assert resp["choices"][0]["token_ids"] == ref_ids, case
        assert resp["choices"][0]["message"]["content"] == ref_text, case
        if case in ("one_photo", "two_turns"):  # streamed too (the hand-off does not depend on it: two cases)
            streamed = stream(url, {"model": tiny_model_path, "messages": _openai_messages(turns), "temperature": 0,
                                    "max_completion_tokens": NEW_TOKENS, "ignore_eos": True,
                                    "return_token_ids": True})
            assert streamed.done and streamed.error is None and streamed.token_ids == ref_ids, case
    log = log_path.read_text()
    assert f"KV hand-off {name}" in log  # both servers say which path they offer
    # Every request had its KV written by the engine, none went through host memory.
    assert log.count("KV received (written by the engine") == len(CASES) + 2
    assert "cannot start" not in log and "KV write to the decode server failed" not in log


def _load(base: str, role: str) -> dict:
    """A stage's load as the gateway's last heartbeat saw it (another stage may be stopped: not fresh)."""
    return stage(details(base, fresh=False), role).get("load") or {}


# NIXL's cases run both servers with TP 2: every rank's engine writes, and a dead decode fails every rank's write.
# The Qwen3.5 case's writes carry each rank's DeltaNet heads of the request's state slot too (TP 2 -> 2).
KILL_CASES = [pytest.param("nixl", "2", "tiny_model_path", id="nixl-tp2", marks=needs("nixl")),
              pytest.param("mooncake", "1", "tiny_model_path", id="mooncake", marks=needs("mooncake")),
              pytest.param("nixl", "2", "tiny_qwen3_5_path", id="nixl-tp2-qwen3.5", marks=needs("nixl"))]


@pytest.mark.parametrize("name,tp,model", KILL_CASES)
def test_decode_killed_during_hand_off_frees_everything(name, tp, model, request, tmp_path_factory):
    """Decode reserves the request's pages (and a hybrid model's state slot) and registers them while prefill is
    stopped; then decode is stopped, prefill prefills and starts its write into the stopped process, and decode is
    killed: the request fails, and every stage is back at baseline (prefill's pages, state slots, rooms and
    registrations, decode's reserved pages and slots); a new decode server serves the same request as before (the
    hybrid model: a text chat too, equal to transformers' generate())."""
    model_path = request.getfixturevalue(model)
    procs = StageProcs(model_path, tmp_path_factory.mktemp(f"stages-{name}"), num_pages=64,
                       request_timeout_s=4.0, lm_args=("--kv-transfer", name, "--tp", tp))
    procs.start()
    try:
        with serve_gateway(procs.gateway_config(stage_timeout_s=10.0)) as (base, _):
            req = body(model_path, "What is in this picture?", image=noise_png(7), max_tokens=8)
            reference = stream(base, req).token_ids
            assert len(reference) == 8
            procs.pause("prefill")
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("r", stream(base, {**req, "max_completion_tokens": 9})))
            t.start()
            assert wait_for(lambda: _load(base, "decode").get("rooms") == 1, 10), details(base, fresh=False)
            procs.pause("decode")
            procs.resume("prefill")
            # Prefilled and handed off: the room is held (the write in flight, or done and waiting for the ack).
            assert wait_for(lambda: (lambda ld: ld.get("rooms") == 1 and not ld.get("num_running_reqs")
                                     and not ld.get("num_waiting_reqs"))(_load(base, "prefill")), 10)
            procs.kill("decode")
            t.join(60)
            assert out["r"].error is not None, out["r"].events[-3:]
            procs.start("decode")
            problems = []

            def ok():
                nonlocal problems
                problems = at_baseline(details(base))
                return not problems

            assert wait_for(ok, 20, 0.3), problems
            assert stream(base, req).token_ids == reference
            if model == "tiny_qwen3_5_path":
                _, ref_ids, _ = _hf_reference(hf_reference_model(model_path), CASES["text"])
                resp = _chat(base, model_path, _openai_messages(CASES["text"]))
                assert resp["choices"][0]["token_ids"] == ref_ids
                assert wait_for(ok, 20, 0.3), problems
    finally:
        procs.stop_all()
