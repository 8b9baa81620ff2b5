"""Observability: every stage's /metrics against what was sent, the request id in all four processes' logs, the
info endpoints, the Grafana dashboard's queries, `epdserve bench --scrape-metrics`, and the log formats.

The live tests use the session's `epdserve launch` (conftest.py: two encoders, DEBUG logs as JSON lines). They send
their requests one test at a time, so the counters' deltas are exactly theirs.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from conftest import launch_metrics_urls
from PIL import Image
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.logging_setup import (JsonFormatter, RequestIdFilter, TextFormatter, request_context,
                                    sanitize_request_id)
from epdserve.encoder.metrics import EncoderMetrics
from epdserve.metrics import DecodeMetrics, GatewayMetrics, PrefillMetrics, StageMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "epdserve.json"
NEW_TOKENS = 6


def _fresh_png(seed: int, size: int = 56) -> bytes:
    """A random-noise PNG no server has seen (its hash is new), ``size`` pixels square."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _body(model: str, images: list[bytes], text: str, **extra) -> dict:
    content = [*map(_image_part, images), {"type": "text", "text": text}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_completion_tokens": NEW_TOKENS, "ignore_eos": True, **extra}


def _scrape(urls: dict[str, str]) -> dict[str, dict[tuple, float]]:
    """Every process's samples: name -> {(sample name, sorted labels): value}; parsing must succeed."""
    out = {}
    for name, url in urls.items():
        r = httpx.get(url, timeout=10, trust_env=False)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        out[name] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                     for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    return out


def _total(scrapes: dict, name: str, stage: str, **labels) -> float:
    """Sum of sample ``name`` with ``stage`` and ``labels`` over every process scraped."""
    want = {("stage", stage), *labels.items()}
    return sum(v for samples in scrapes.values() for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _delta(before, after, name, stage, **labels) -> float:
    return _total(after, name, stage, **labels) - _total(before, name, stage, **labels)


@pytest.fixture(scope="module")
def metrics_urls(server) -> dict[str, str]:
    urls = launch_metrics_urls(server[1])
    assert set(urls) == {"gateway", "encoder0", "encoder1", "prefill", "decode"}
    return urls


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server[0]}/v1/models", timeout=10).json()["data"][0]["id"]


def test_counters_move_by_exactly_what_was_sent(server, metrics_urls, model):
    url, _ = server
    tag = uuid.uuid4().int % 10**9
    a, b = _fresh_png(tag), _fresh_png(tag + 1)
    before = _scrape(metrics_urls)
    bodies = [
        _body(model, [a], "What is this?"),
        _body(model, [b, a], "Compare them."),  # a again: an embedding-cache hit
        _body(model, [], "No image here."),
        _body(model, [a], "What is this?", stream=True, stream_options={"include_usage": True}),  # a third time
    ]
    usages = []
    for body in bodies:
        if body.get("stream"):
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            usages.append(events[-1]["usage"])
        else:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    after = _scrape(metrics_urls)
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert completion == NEW_TOKENS * len(bodies) and cached > 0  # the repeated prompt hit the radix cache
    d = lambda name, stage, **kw: _delta(before, after, "epdserve:" + name, stage, **kw)  # noqa: E731
    # The responses' usage, counted by the gateway and by the stage that did the work.
    assert d("prompt_tokens_total", "gateway") == prompt == d("prompt_tokens_total", "prefill")
    assert d("generation_tokens_total", "gateway") == completion == d("generation_tokens_total", "decode")
    assert d("cached_tokens_total", "gateway") == cached == d("cached_tokens_total", "prefill")
    assert 0 < d("cached_image_tokens_total", "prefill") <= cached
    # Images: 4 sent, 2 distinct and new (encoded once each), a's second and third lookups hit the cache.
    assert d("encoder_images_total", "encoder") == 4
    assert d("images_encoded_total", "encoder") == 2
    assert d("embedding_cache_hits_total", "encoder") == 2
    assert d("embedding_cache_misses_total", "encoder") == 2
    assert d("embedding_bytes_sent_total", "encoder") > 0
    # Each encoded image's decode timed once; each Encode request (all have targets here) pushed once, in time.
    assert d("image_decode_seconds_count", "encoder") == 2 and d("image_decode_seconds_sum", "encoder") > 0
    pushes = d("embedding_push_seconds_count", "encoder")
    assert pushes == d("num_requests_total", "encoder", outcome="ok") >= 3
    assert d("embedding_push_seconds_sum", "encoder") > 0
    # One observation per request where one is due.
    n = len(bodies)
    assert d("num_requests_total", "gateway", outcome="length") == n
    assert d("time_to_first_token_seconds_count", "gateway") == n
    assert d("e2e_request_latency_seconds_count", "gateway") == n
    assert d("time_per_output_token_seconds_count", "gateway") == n
    assert d("inter_token_latency_seconds_count", "gateway") > 0
    assert d("encode_request_latency_seconds_count", "gateway") == 3
    assert d("num_requests_total", "prefill", outcome="ok") == n == d("num_requests_total", "decode", outcome="length")
    assert d("queue_time_seconds_count", "prefill") == n == d("queue_time_seconds_count", "decode")
    kv = d("kv_transfer_bytes_total", "prefill")
    assert kv > 0 and kv == d("kv_transfer_bytes_total", "decode")
    assert d("kv_transfer_latency_seconds_count", "decode") == n
    assert _total(after, "epdserve:errors_total", "gateway") == _total(before, "epdserve:errors_total", "gateway")
    # Gauges: the LM servers' pools, and nothing in flight at the gateway once all answered.
    assert _total(after, "epdserve:kv_pages_total", "prefill") > 0
    assert _total(after, "epdserve:num_running_reqs", "gateway") == 0


def test_every_exposition_parses_and_carries_its_stage(metrics_urls):
    classes = {"gateway": GatewayMetrics, "encoder0": EncoderMetrics, "encoder1": EncoderMetrics,
               "prefill": PrefillMetrics, "decode": DecodeMetrics}
    for name, url in metrics_urls.items():
        text = httpx.get(url, timeout=10, trust_env=False).text
        families = {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
        expected = classes[name]()
        assert set(families) == {f.name for f in expected.registry.collect()}, name
        stage = expected.stage
        assert all(s.labels.get("stage") == stage for f in families.values() for s in f.samples), name


def _exported_names(metrics: StageMetrics) -> set[str]:
    """Every sample name a registry can expose: counters' ``_total``/``_created``, histograms' series, gauges."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",)}
    return {f.name + s for f in metrics.registry.collect() for s in suffixes[f.type]}


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(row title, PromQL expression) of every panel target in the dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    out, row = [], None
    for panel in doc["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        for target in panel.get("targets", []):
            out.append((row, target["expr"]))
    return out


def test_dashboard_queries_use_only_exported_names():
    exported = set().union(*(_exported_names(c()) for c in (GatewayMetrics, EncoderMetrics, PrefillMetrics,
                                                              DecodeMetrics)))
    exprs = _dashboard_exprs()
    used = {m for _, e in exprs for m in re.findall(r"epdserve:[A-Za-z0-9_:]+", e)}
    assert used and used <= exported, sorted(used - exported)
    # Every query names an epdserve metric, and the stage labels it filters on exist.
    assert all(re.search(r"epdserve:", e) for _, e in exprs)
    stages = {m for _, e in exprs for m in re.findall(r'stage="([a-z]+)"', e)}
    assert stages == {"gateway", "encoder", "prefill", "decode"}
    rows = {r for r, _ in exprs}
    assert {"Gateway", "Encoder", "Prefill", "Decode"} <= rows


def test_ready_lines_say_how_long_each_part_of_the_start_took(server):
    """Prefill's and decode's ready lines end with the start-up's parts (issue 43): the process's own start
    (interpreter, imports), weights and warm-up always (CPU: no graphs), each in seconds, and a total equal to their
    sum."""
    _, log_path = server
    messages = [json.loads(x)["message"] for x in log_path.read_text().splitlines() if x.startswith("{")]
    for stage in ("prefill", "decode"):
        line = next(m for m in messages if m.startswith(f"{stage} ready on"))
        m = re.search(r"started in ([\d.]+) s \((.*)\)$", line)
        assert m, line
        parts = dict((name, float(sec)) for name, sec in re.findall(r"([\w-]+) ([\d.]+) s", m.group(2)))
        assert {"process", "weights", "warm-up"} <= parts.keys(), line
        assert list(parts)[0] == "process" and parts["process"] > 0, line  # the imports came first, and took time
        # Each figure is rounded to 0.1 s: the parts' sum and the total differ by at most half of that each.
        assert abs(sum(parts.values()) - float(m.group(1))) <= 0.05 * (len(parts) + 1) + 1e-9, line


def test_process_age_counts_from_the_process_start():
    """A child that sleeps 1 s after its imports reports an age of at least that, and not much more than the
    child's whole life as the parent timed it: the part of a ready line no timer inside the process can see."""
    code = ("import time; t = time.monotonic(); time.sleep(1.0); from epdserve.logging_setup import process_age_s;"
            " print(process_age_s(), time.monotonic() - t)")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    life = time.monotonic() - t0
    age, slept = (float(x) for x in out.stdout.split())
    # /proc's start time is in clock ticks (10 ms): allow one tick either way.
    assert slept + 0.0 <= age + 0.011 and age <= life + 0.011, (age, slept, life)


def test_request_id_reaches_every_process_log(server, model):
    url, log_path = server
    rid = f"obs-{uuid.uuid4().hex[:12]}"
    r = httpx.post(f"{url}/v1/chat/completions", json=_body(model, [_fresh_png(7)], "Trace me."), timeout=120,
                   headers={"X-Request-Id": rid + ' \t"<>{}'})  # sanitized: the junk is dropped
    assert r.status_code == 200, r.text
    assert r.json()["id"] == rid and r.headers["x-request-id"] == rid
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
    loggers = {x["logger"].split(".")[1] for x in lines if x.get("rid") == rid}
    assert loggers >= {"gateway", "encoder", "prefill", "decode"}, loggers
    # Every line that names the request in its message carries it as a field too.
    assert all(x.get("rid") == rid for x in lines if f"rid={rid}" in x["message"])
    # An id in flight cannot be reused (the stages key their state by it); once its stream is over, it can.
    body = _body(model, [], "Count slowly to a thousand.", max_completion_tokens=1000, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid},
                      timeout=120) as first:
        assert first.status_code == 200
        again = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
        assert again.status_code == 400 and again.json()["error"]["code"] == "duplicate_request_id"
    deadline = time.monotonic() + 10  # leaving the stream early is a client disconnect: the gateway aborts it
    while (ok := httpx.post(f"{url}/v1/chat/completions", json=_body(model, [], "Again."), timeout=120,
                            headers={"X-Request-Id": rid})).status_code == 400 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ok.status_code == 200 and ok.json()["id"] == rid


def test_model_and_server_info(server, tiny_model_path):
    from epdserve.proto import encoder_pb2, encoder_pb2_grpc

    url, _ = server
    info = httpx.get(f"{url}/get_model_info", timeout=10).json()
    assert info["model_path"] == tiny_model_path and info["is_generation"] and info["tp_size"] == 1
    assert info["context_length"] > 0 and info["page_size"] == {"prefill": 16, "decode": 16}
    assert info["kv_pool_tokens"]["decode"] == info["kv_pool_pages"]["decode"] * 16
    srv = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert srv["ready"] and srv["flags"]["port"] == int(url.rsplit(":", 1)[1])
    assert [s["role"] for s in srv["prefill"]] == ["prefill"] and [s["role"] for s in srv["decode"]] == ["decode"]
    assert info["num_servers"] == {"prefill": 1, "decode": 1}
    assert len(srv["encoders"]) == 2
    for enc in srv["encoders"]:
        e = enc["info"]
        assert e["ready"] and e["flags"]["port"] == enc["addr"].rsplit(":", 1)[1]
        assert e["metrics_port"] == int(e["flags"]["metrics_port"]) and isinstance(e["cache_hits"], int)
        with grpc.insecure_channel(enc["addr"]) as ch:
            m = encoder_pb2_grpc.EncoderStub(ch).GetModelInfo(encoder_pb2.GetModelInfoRequest(), timeout=10)
        assert (m.model_path, m.model_type, m.spatial_merge_size, m.out_hidden_size) == \
               (tiny_model_path, "qwen2_5_vl", 2, 128)


def test_bench_scrapes_server_metrics(server, metrics_urls, model, tmp_path, capsys):
    from epdserve.bench.cli import main as bench

    url, _ = server
    out = tmp_path / "bench.json"
    code = bench(["--base-url", url, "--model", model, "--dataset", "random-mm", "--num-prompts", "3",
                  "--image-sizes", "56x56", "--input-len", "8", "--output-len", "4", "--max-concurrency", "2",
                  "--seed", str(uuid.uuid4().int % 1000), "--disable-tqdm", "--output-json", str(out),
                  "--scrape-metrics", ",".join(metrics_urls.values())])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Server-side Metrics" in printed and "images_encoded:" in printed
    doc = json.loads(out.read_text())
    s, server_side = doc["summary"], doc["summary"]["server_metrics"]
    # The warm-up request ran before the first scrape: the server counted exactly the measured requests.
    assert server_side["gateway"]["requests"] == s["successful_requests"] == 3
    assert server_side["gateway"]["prompt_tokens"] == s["total_input_tokens"] == server_side["prefill"]["prompt_tokens"]
    assert server_side["decode"]["generation_tokens"] == s["total_output_tokens"] == 12
    assert server_side["encoder"]["images"] == 3
    assert server_side["decode"]["grammar_fill_ms_mean"] is None  # no constrained request: no such step
    # 4 tokens a request, the first from prefill: decode launched steps, and waited on some of them
    assert server_side["decode"]["step_launch_ms_mean"] > 0 and server_side["decode"]["step_wait_ms_mean"] >= 0
    # Every stage did device work during the run, and no more of it than the run lasted (one process each).
    for stage in ("encoder", "prefill", "decode"):
        busy, share = server_side[stage]["device_busy_s"], server_side[stage]["device_busy_share"]
        assert busy > 0 and 0 < share <= 1, (stage, busy, share)
        assert share == pytest.approx(busy / s["duration_s"], rel=0.5)


# ---- without servers ------------------------------------------------------------------------------------------

def test_log_formats_name_the_request(caplog):
    logger = logging.getLogger("epdserve.test_obs")
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 1, "rid=%s done", ("abc-1",), None)
    assert json.loads(JsonFormatter().format(record))["rid"] == "abc-1"
    filt = RequestIdFilter()
    with request_context("ctx-2"):
        plain = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "encoder %s is down", ("e1",), None)
        filt.filter(plain)
    doc = json.loads(JsonFormatter().format(plain))
    assert doc["rid"] == "ctx-2" and doc["message"] == "encoder e1 is down" and doc["level"] == "WARNING"
    assert TextFormatter().format(plain).endswith("epdserve.test_obs: encoder e1 is down rid=ctx-2")
    filt.filter(record)  # a message that names its request is not named twice
    assert TextFormatter().format(record).endswith(": rid=abc-1 done")
    assert sanitize_request_id('a b"c\n{}') == "abc" and sanitize_request_id("\n") is None
    assert len(sanitize_request_id("x" * 1000)) == 128


def test_separate_registries_and_request_trace():
    one, two = GatewayMetrics(), GatewayMetrics()  # two gateways in one process never share a counter
    trace = one.trace()
    trace.output(1)
    trace.output(2)
    usage = type("U", (), {"prompt_tokens": 10, "completion_tokens": 3,
                           "prompt_tokens_details": type("D", (), {"cached_tokens": 4})()})()
    trace.finish("stop", usage)
    trace.finish("stop", usage)  # counted once
    trace.fail("client_disconnected")  # ignored after finish
    assert one.value("epdserve:prompt_tokens_total") == 10 and two.value("epdserve:prompt_tokens_total") == 0
    assert one.value("epdserve:cached_tokens_total") == 4
    assert one.value("epdserve:num_requests_total", outcome="stop") == 1
    assert one.value("epdserve:inter_token_latency_seconds_count") == 1
    assert one.value("epdserve:errors_total", kind="client_disconnected") == 0
    assert b'epdserve:time_to_first_token_seconds_count{stage="gateway"} 1.0' in generate_latest(one.registry)


def test_multiprocess_mode_adds_up_processes(tmp_path):
    """Under PROMETHEUS_MULTIPROC_DIR, the exposition of one process adds up the counters of all (TP ranks)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    record = ("from epdserve.metrics import PrefillMetrics; m = PrefillMetrics(); m.prompt_tokens.inc(5); "
              "m.on_error('x'); m.cache_hit_rate.set(0.5)")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", record], env=env, check=True, timeout=60)
    expose = ("from epdserve.metrics import PrefillMetrics, exposition_registry; "
              "from prometheus_client import generate_latest; "
              "print(generate_latest(exposition_registry(PrefillMetrics().registry)).decode())")
    text = subprocess.run([sys.executable, "-c", expose], env=env, check=True, timeout=60, capture_output=True,
                          text=True).stdout
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("epdserve:prompt_tokens_total", (("stage", "prefill"),))] == 10
    assert samples[("epdserve:errors_total", (("kind", "x"), ("stage", "prefill")))] == 2
    assert samples[("epdserve:cache_hit_rate", (("stage", "prefill"),))] == 0.5


def test_log_format_flag_before_or_after_the_subcommand(monkeypatch):
    import epdserve.entry.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_run_server", lambda name, config: 0)
    monkeypatch.setattr(cli, "setup_logging", lambda level, fmt: seen.append(fmt))
    for argv in (["prefill"], ["--log-format", "json", "decode"], ["encoder", "--log-format", "json"]):
        assert cli.main(argv) == 0
    assert seen == ["text", "json", "json"]
    with pytest.raises(SystemExit):
        cli.main(["gateway", "--log-format", "yaml"])
