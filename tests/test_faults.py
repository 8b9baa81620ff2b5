"""Faults and overload against the real stage processes (tiny model, CPU): nothing hangs, nothing leaks, every
failure is a clear error.

- Client disconnects and deadlines leave every stage's accounting (``Load``: requests, KV pages, rooms,
  embeddings; the encoder's ``GetLoad``) at baseline.
- 32 clients whose requests together need several times the decode KV pool all succeed (they wait for pages) and
  the pool is back at baseline afterwards. ``EPDSERVE_LOAD_S`` sets how long the clients keep sending (default a
  few seconds here; the issue's 60 s run: ``EPDSERVE_LOAD_S=60 pytest tests/test_faults.py -k load``).
- Killing decode, prefill or the encoder (SIGKILL) under 16 streams ends the affected ones with an error within
  the stage deadline, answers new requests with 503 meanwhile, and a restarted stage rejoins by itself; a stopped
  (SIGSTOP) decode is caught by the heartbeat. Each restart is followed by a greedy request that must give the
  tokens it gave before the fault.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import threading
import time

import httpx
import pytest
from cluster import at_baseline, body, details, health, noise_png, serve_gateway, stream, wait_for

STAGE_TIMEOUT_S = 3.0  # the gateway's --stage-timeout-s here (the default is 10)
LOAD_S = float(os.environ.get("EPDSERVE_LOAD_S", "4"))
# Slack on top of a deadline for the client to see the end (thread scheduling on a busy 2-core machine).
SLACK_S = 1.5


@pytest.fixture(scope="module")
def gateway(stage_procs):
    with serve_gateway(stage_procs.gateway_config(stage_timeout_s=STAGE_TIMEOUT_S)) as (base, app):
        yield base, app


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return tiny_model_path


@pytest.fixture(scope="module")
def reference(gateway, model):
    """Greedy token ids of one text and one image request, before any fault: every restart must reproduce them."""
    base, _ = gateway
    reqs = {"text": body(model, "Tell me about the sea.", max_tokens=24),
            "image": body(model, "What is in this picture?", image=noise_png(10_000), max_tokens=24)}
    return reqs, {k: _post(base, r).json()["choices"][0]["token_ids"] for k, r in reqs.items()}


def _post(base: str, req: dict, timeout_s: float = 120.0) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=req, timeout=timeout_s)


def _assert_reference(base: str, reference) -> None:
    reqs, expected = reference
    for kind, req in reqs.items():
        r = _post(base, req)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[kind], kind


def _assert_baseline(base: str, timeout_s: float = 20.0, ignore: tuple[str, ...] = ()) -> None:
    problems: list[str] = []

    def ok() -> bool:
        nonlocal problems
        problems = [p for p in at_baseline(details(base)) if not p.startswith(ignore)]
        return not problems

    assert wait_for(ok, timeout_s, 0.3), f"not back at baseline after {timeout_s} s: {problems}"


def test_health_details(gateway, reference):
    base, _ = gateway
    d = details(base)
    assert d["status"] == "ok"
    for role in ("prefill", "decode"):
        assert d["stages"][role][0]["up"] and d["stages"][role][0]["load"]["kv_pages_total"] == 256
    (enc,) = d["stages"]["encoders"]
    assert enc["up"] and enc["load"]["cached_embeddings"] >= 1  # the reference image
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    _assert_baseline(base)


def test_disconnects_and_timeouts_leave_stages_at_baseline(stage_procs, gateway, model):
    """100 streams whose clients hang up after their first token, 50 requests whose clients time out, and 50 that
    pass the gateway's own deadline (--request-timeout-s): afterwards no stage holds anything for them."""
    base, _ = gateway

    def hang_up(i: int) -> bool:
        req = body(model, f"Story number {i}, please.", image=noise_png(i) if i % 3 == 0 else None, max_tokens=300)
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**req, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if '"token_ids":[' in line and '"role"' not in line:
                    return True  # leaving the block closes the connection mid-stream
        return False

    def client_timeout(i: int) -> str:
        # 1,000 tokens: long enough that a client's deadline (up to 1.5 s) nearly always comes first, even on a
        # machine with nothing else running (300 let ~a quarter finish there).
        req = body(model, f"Question {i}?", image=noise_png(1000 + i) if i % 2 else None, max_tokens=1000)
        try:
            _post(base, req, timeout_s=random.Random(i).uniform(0.05, 1.5))
        except httpx.TimeoutException:
            return "timeout"
        return "finished"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(pool.map(hang_up, range(100)))
        client_side = list(pool.map(client_timeout, range(50)))
    assert client_side.count("timeout") >= 40

    # The gateway's deadline: a second gateway on the same stages with a short --request-timeout-s, so that the
    # deadline falls in every phase (encoding, prefill, waiting for KV, decoding).
    with serve_gateway(stage_procs.gateway_config(request_timeout_s=0.6)) as (short, _):
        def deadline(i: int) -> tuple[int, dict | None]:
            # 1,000 tokens, as above: a text request of 400 could finish inside the 0.6 s on an idle machine.
            req = body(model, f"Deadline {i}", image=noise_png(2000 + i) if i % 2 else None, max_tokens=1000)
            if i % 4 < 2:
                r = _post(short, req)
                return r.status_code, r.json().get("error")
            res = stream(short, req)
            return res.status, res.error

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(deadline, range(50)))
        for status, error in outcomes:
            assert error is not None and error["code"] == 504 and status in (200, 504), (status, error)
        _assert_baseline(short)
    _assert_baseline(base)


def test_load_past_the_kv_pool_all_succeed(gateway, model):
    """32 clients, each request reserving ~1/15 of the decode KV pool: they queue for pages, none fails or hangs."""
    base, _ = gateway
    max_tokens, hung_s = 240, 120.0
    stop_at = time.monotonic() + LOAD_S
    results: list[tuple[int, int, float]] = []  # (status, completion tokens, seconds)
    loads: list[dict] = []
    sampling = threading.Event()

    def client(c: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            req = body(model, f"Client {c}, request {n}: a long story.", max_tokens=max_tokens,
                       image=noise_png(5000 + c * 1000 + n) if n % 4 == 3 else None)
            t0 = time.monotonic()
            try:
                r = _post(base, req, timeout_s=hung_s)
                results.append((r.status_code, r.json().get("usage", {}).get("completion_tokens", -1),
                                time.monotonic() - t0))
            except httpx.TimeoutException:
                results.append((0, -1, hung_s))  # hung
            n += 1

    def sample() -> None:
        while not sampling.is_set():
            d = details(base, fresh=True)
            if "load" in d["stages"]["decode"][0]:
                loads.append(d["stages"]["decode"][0]["load"])
            time.sleep(0.3)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            list(pool.map(client, range(32)))
    finally:
        sampling.set()
        sampler.join()
    failed = [r for r in results if r[0] != 200 or r[1] != max_tokens]
    print(f"load: {len(results)} requests in {LOAD_S:g} s of sending, {len(failed)} failed or hung, "
          f"longest {max(r[2] for r in results):.1f} s")
    assert len(results) >= 32 and not failed
    assert max(ld["kv_pages_used"] for ld in loads) > 0.8 * loads[0]["kv_pages_total"]  # the pool did fill
    assert max(ld["num_waiting_reqs"] for ld in loads) > 0 or len(results) > 32  # ... and requests waited
    _assert_baseline(base)


def _streams(base: str, model: str, n: int, *, max_tokens: int, image_from: int | None = None):
    """Start ``n`` streams in threads; return (futures, per-stream "first token seen" events, pool)."""
    pool = concurrent.futures.ThreadPoolExecutor(n)
    started = [threading.Event() for _ in range(n)]
    futs = [pool.submit(stream, base, body(model, f"Stream {i}: go on and on.", max_tokens=max_tokens,
                                           image=None if image_from is None else noise_png(image_from + i)),
                        started[i], 120.0)
            for i in range(n)]
    return futs, started, pool


def _assert_503_now(base: str, req: dict) -> None:
    t0 = time.monotonic()
    r = _post(base, req, timeout_s=30)
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after") and r.json()["error"]["type"] == "service_unavailable"
    assert time.monotonic() - t0 < 1.0  # refused at once, not after waiting for the dead stage


def test_kill_decode_ends_every_stream_then_restart(stage_procs, gateway, model, reference):
    base, _ = gateway
    # 8 streams of 400 tokens (3.4k of decode's 4k KV slots): the last starts (one prefill after another) long
    # before the first can finish, which 16 of 200 did not always do on a loaded 2-core machine.
    futs, started, pool = _streams(base, model, 8, max_tokens=400)
    try:
        with pool:
            assert all(e.wait(60) for e in started), "the 8 streams did not all start"
            killed_at = time.monotonic()
            stage_procs.kill("decode")
            assert wait_for(lambda: health(base) == 503, STAGE_TIMEOUT_S)
            _assert_503_now(base, body(model, "Anyone there?"))
            results = [f.result(timeout=STAGE_TIMEOUT_S + 30) for f in futs]
        for res in results:
            assert res.status == 200 and res.done and res.error is not None, res.events[-3:]
            assert res.error["code"] == 503 and "decode" in res.error["message"]
            assert res.ended_at - killed_at <= STAGE_TIMEOUT_S + SLACK_S
    finally:  # the stages are shared by later tests: a failure here must not leave them without a decode
        if "decode" in stage_procs.procs:
            stage_procs.kill("decode")
        stage_procs.start("decode")
    assert wait_for(lambda: health(base) == 200, 30), details(base)
    _assert_reference(base, reference)


def test_stopped_decode_caught_by_heartbeat(stage_procs, gateway, model, reference):
    """SIGSTOP keeps decode's connections open but silent: only the heartbeat can tell; then SIGCONT."""
    base, _ = gateway
    futs, started, pool = _streams(base, model, 4, max_tokens=200)
    with pool:
        assert all(e.wait(60) for e in started)
        stopped_at = time.monotonic()
        stage_procs.pause("decode")
        try:
            results = [f.result(timeout=STAGE_TIMEOUT_S + 30) for f in futs]
            _assert_503_now(base, body(model, "Anyone there?"))
        finally:
            stage_procs.resume("decode")
    for res in results:
        assert res.error is not None and res.error["code"] == 503 and res.done
        assert res.ended_at - stopped_at <= STAGE_TIMEOUT_S + SLACK_S
    assert wait_for(lambda: health(base) == 200, 30), details(base)
    _assert_reference(base, reference)
    _assert_baseline(base)


def test_kill_encoder_fails_image_requests_text_carries_on(stage_procs, gateway, model, reference):
    base, _ = gateway
    text, started, pool = _streams(base, model, 8, max_tokens=200)
    with pool:
        assert all(e.wait(60) for e in started)
        images, _, pool2 = _streams(base, model, 8, max_tokens=50, image_from=30_000)
        with pool2:
            time.sleep(0.05)
            killed_at = time.monotonic()
            stage_procs.kill("encoder")
            img = [f.result(timeout=STAGE_TIMEOUT_S + 30) for f in images]
            _assert_503_now(base, body(model, "And this?", image=noise_png(31_000)))
            assert _post(base, body(model, "Text still works.", max_tokens=4)).status_code == 200
            # Text is served, but the gateway is not ready for every request it takes: /health says why.
            assert health(base) == 503 and health(base, "/health/live") == 200
            d = details(base)
            (enc,) = d["stages"]["encoders"]
            assert not enc["up"] and d["reason"].startswith("no encoder is serving")
        done = [f.result(timeout=60) for f in text]
    for res in done:
        assert res.error is None and res.finish_reason == "length"
    for res in img:
        if res.error is not None:
            assert res.error["code"] == 503 and res.ended_at - killed_at <= STAGE_TIMEOUT_S + SLACK_S, res.error
        else:
            assert res.finish_reason == "length"
    stage_procs.start("encoder")
    assert wait_for(lambda: details(base)["stages"]["encoders"][0]["up"], 30)
    assert health(base) == 200
    _assert_reference(base, reference)
    _assert_baseline(base)


def test_kill_prefill_ends_waiting_requests_others_carry_on(stage_procs, gateway, model, reference):
    """Streams already decoding finish normally; those still needing prefill end with 503 within the deadline."""
    base, _ = gateway
    decoding, started, pool = _streams(base, model, 8, max_tokens=200)
    try:
        with pool:
            assert all(e.wait(60) for e in started)
            # Paused first, so the later requests still need it when it dies: on an idle machine the tiny model
            # prefilled all eight within the 0.1 s below, and none was left to fail.
            stage_procs.pause("prefill")
            later, _, pool2 = _streams(base, model, 8, max_tokens=200, image_from=20_000)
            with pool2:
                time.sleep(0.1)
                killed_at = time.monotonic()
                stage_procs.kill("prefill")
                assert wait_for(lambda: health(base) == 503, STAGE_TIMEOUT_S)
                _assert_503_now(base, body(model, "Anyone there?"))
                late = [f.result(timeout=STAGE_TIMEOUT_S + 30) for f in later]
            done = [f.result(timeout=60) for f in decoding]
        for res in done:  # decode had their KV: the prefill server's death is none of their business
            assert res.error is None and res.finish_reason == "length" and len(res.token_ids) == 200
        for res in late:
            if res.error is not None:
                assert res.error["code"] == 503 and res.ended_at - killed_at <= STAGE_TIMEOUT_S + SLACK_S, res.error
            else:
                assert res.finish_reason == "length"
        assert any(res.error is not None for res in late)
    finally:  # the stages are shared by later tests: a failure here must not leave them without a prefill
        if "prefill" in stage_procs.procs:  # failed before the kill: perhaps paused
            stage_procs.kill("prefill")
        stage_procs.start("prefill")
    assert wait_for(lambda: health(base) == 200, 30), details(base)
    _assert_reference(base, reference)
    # Decode's registrations for the failed requests were queued for the dead prefill and reach the new one,
    # which holds them until --request-timeout-s: rooms are the one thing not back at once (see README), and
    # they do go then. Waiting here also hands the shared stages on at rest (a later test's baseline check once
    # saw one of these rooms).
    _assert_baseline(base, ignore=("prefill.rooms",))
    _assert_baseline(base, timeout_s=stage_procs.request_timeout_s + 10)
