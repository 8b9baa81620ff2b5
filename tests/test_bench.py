"""epdserve bench against a stub OpenAI server with injected timings (CPU, a few seconds each)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
from dataclasses import fields

import httpx
import numpy as np
import pytest
from PIL import Image

from epdserve.bench.cli import chat_url, main
from epdserve.bench.client import RequestRecord
from epdserve.bench.datasets import DatasetOptions, build_requests, with_output_lens
from epdserve.bench.metrics import parse_slo
from epdserve.bench.runner import arrival_offsets
from epdserve.bench.stub import StubBehavior, StubServer
from epdserve.bench.synth import WORDS, TextMaker

TTFT_S, ITL_S, OUT_LEN = 0.2, 0.05, 8
# Small synthetic images and prompts: the stub ignores content, so only the timing matters.
SMALL = ["--image-sizes", "32x32", "--input-len", "8", "--output-len", str(OUT_LEN), "--disable-tqdm"]


def _run(url: str, *args: str) -> int:
    return main(["--base-url", url, "--model", "stub-model", *SMALL, *args])


def _load(path) -> dict:
    def no_nan(name):  # strict JSON: Infinity/NaN would not load in other languages' parsers
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=no_nan)


def test_measured_timings_match_injected_delays(tmp_path):
    out = tmp_path / "run.json"
    # As many warm-up requests as the concurrency: they open the 3 connections the run reuses, so no measured TTFT
    # holds a TCP connect, which is no injected delay (on a CPU-starved machine one costs tens of ms).
    with StubServer(StubBehavior(ttft_s=TTFT_S, itl_s=ITL_S)) as stub:
        rc = _run(stub.url, "--num-prompts", "6", "--max-concurrency", "3", "--warmup", "3", "--output-json", str(out))
        bodies = stub.state.bodies
    assert rc == 0
    doc = _load(out)
    reqs, s = doc["requests"], doc["summary"]
    assert len(reqs) == 6 and s["successful_requests"] == 6 and s["failed_requests"] == 0
    # The run's figures match the injected delays within 10 %. The stub sends a role-only chunk at once, so a
    # TTFT near 0 would mean the role chunk was taken for a token.
    assert s["ttft_ms"]["median"] == pytest.approx(TTFT_S * 1e3, rel=0.10)
    assert s["itl_ms"]["mean"] == pytest.approx(ITL_S * 1e3, rel=0.10)
    assert s["tpot_ms"]["mean"] == pytest.approx(ITL_S * 1e3, rel=0.10)  # (e2e - ttft)/(n - 1), 1 token a chunk
    assert s["e2e_ms"]["median"] == pytest.approx((TTFT_S + (OUT_LEN - 1) * ITL_S) * 1e3, rel=0.10)
    # Every request is close too; the wider margin leaves room for one request delayed by a busy machine.
    for r in reqs:
        assert r["ttft_s"] == pytest.approx(TTFT_S, rel=0.20)
        assert len(r["itl_s"]) == OUT_LEN - 1 and np.mean(r["itl_s"]) == pytest.approx(ITL_S, rel=0.20)
        assert r["completion_tokens"] == OUT_LEN and r["cached_tokens"] == 0 and r["usage_reported"]
    assert s["total_output_tokens"] == 6 * OUT_LEN
    # The client's own bookkeeping is microseconds against a 50 ms gap.
    assert s["client"]["overhead_per_event_us"] < 1000
    assert s["client"]["overhead_share_of_mean_itl"] < 0.01
    # What went over the wire: the vLLM/SGLang benchmark request shape, images inline.
    assert len(bodies) == 9  # 3 warm-up + 6
    b = bodies[0]
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["max_completion_tokens"] == OUT_LEN and b["ignore_eos"] is True and b["model"] == "stub-model"
    url = b["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")


def test_failures_are_counted_and_summarised(tmp_path, capsys):
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=0.01, itl_s=0.001, fail_every=3, stream_error_every=4)) as stub:
        rc = _run(stub.url, "--num-prompts", "12", "--warmup", "0", "--output-json", str(out))
    assert rc == 1
    s = _load(out)["summary"]
    # Arrivals 3, 6, 9, 12 answer HTTP 500; 4 and 8 break mid-stream.
    assert s["failed_requests"] == 6 and s["successful_requests"] == 6
    assert s["errors"] == {"HTTP 500: injected failure": 4, "stream error: injected stream error": 2}
    table = capsys.readouterr().out
    assert "Failed requests:                         6" in table and "HTTP 500: injected failure" in table


def test_role_chunk_is_not_a_token_even_when_all_text_is_empty(tmp_path):
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=TTFT_S, itl_s=0.01, empty_text=True)) as stub:
        assert _run(stub.url, "--num-prompts", "2", "--warmup", "0", "--output-json", str(out)) == 0
    for r in _load(out)["requests"]:
        # No chunk has text: TTFT falls back to the first non-role chunk, never to the immediate role chunk.
        assert r["ttft_s"] == pytest.approx(TTFT_S, rel=0.20) and r["itl_s"] == [] and r["num_chunks"] == 0
        assert r["completion_tokens"] == OUT_LEN


def test_timeouts_and_refused_connections_fail_loudly(tmp_path):
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=5.0)) as stub:
        rc = _run(stub.url, "--num-prompts", "2", "--warmup", "0", "--timeout", "0.3", "--output-json", str(out))
    assert rc == 1
    assert _load(out)["summary"]["errors"] == {"timeout after 0.3 s": 2}

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert _run(dead, "--num-prompts", "2", "--warmup", "0", "--output-json", str(out)) == 1
    errors = _load(out)["summary"]["errors"]
    assert sum(errors.values()) == 2 and all(k.startswith("ClientConnectorError") for k in errors)
    # With warm-up, a dead server stops the run before it starts.
    assert _run(dead, "--num-prompts", "2", "--warmup", "1") == 1


def test_a_run_of_cached_prompts_is_flagged(tmp_path):
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=0.01, itl_s=0.001, cached_tokens=10_000)) as stub:
        assert _run(stub.url, "--num-prompts", "2", "--warmup", "0", "--output-json", str(out)) == 0
    s = _load(out)["summary"]
    assert s["cached_token_share"] > 0.5
    assert any("prefix cache" in w for w in s["warnings"])


def test_json_schema_and_plot(tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    with StubServer(StubBehavior(ttft_s=0.05, itl_s=0.01, cached_tokens=3)) as stub:
        rc = _run(stub.url, "--num-prompts", "5", "--request-rate", "50", "--slo", "ttft=1000,tpot=1",
                  "--save-text", "--output-json", str(out), "--plot", str(png),
                  "--api-key", "sk-secret1", "--header", "X-Token=secret2")
    assert rc == 0
    assert "secret" not in out.read_text()  # no credentials in result files
    doc = _load(out)
    assert doc["config"]["header"] == ["X-Token"]
    assert doc["schema"] == "epdserve.bench/1"
    assert set(doc) == {"schema", "created", "config", "summary", "requests", "warmup_requests"}
    assert doc["config"]["model"] == "stub-model" and doc["config"]["request_rate"] == 50.0
    assert doc["config"]["url"].endswith("/v1/chat/completions") and "api_key" not in doc["config"]
    record_keys = {f.name for f in fields(RequestRecord)}
    assert all(set(r) == record_keys for r in doc["requests"] + doc["warmup_requests"])
    assert doc["requests"][0]["output_text"].startswith("t0 t1")
    s = doc["summary"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"count", "mean", "median", "p90", "p99", "std", "min", "max"}
    for key in ("request_throughput_rps", "input_token_throughput_tps", "output_token_throughput_tps",
                "total_token_throughput_tps", "duration_s", "errors", "client", "timeline", "warnings"):
        assert key in s
    assert s["total_cached_tokens"] == 15 and not any("prefix cache" in w for w in s["warnings"])
    # TPOT here is ~10 ms, so an SLO of 1 ms admits nothing; TTFT alone would admit all.
    assert s["slo_ms"] == {"ttft": 1000.0, "tpot": 1.0} and s["good_requests"] == 0 and s["goodput_rps"] == 0
    tl = s["timeline"]
    assert len(tl["t_s"]) == len(tl["output_tokens_per_s"]) == len(tl["in_flight_mean"])
    assert sum(tl["output_tokens_per_s"]) * tl["bin_s"] == pytest.approx(5 * OUT_LEN)
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 500


def test_poisson_schedule():
    gaps = np.diff(arrival_offsets(20001, rate=10.0, seed=1))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1
    bursty = np.diff(arrival_offsets(20001, rate=10.0, burstiness=0.5, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2**0.5, rel=0.05)  # gamma shape k: CV 1/sqrt(k)
    assert not arrival_offsets(5, float("inf")).any()
    assert np.array_equal(arrival_offsets(50, 4.0, seed=7), arrival_offsets(50, 4.0, seed=7))


def test_arrivals_follow_the_rate_live(tmp_path):
    out = tmp_path / "run.json"
    rate, n = 25.0, 30
    with StubServer(StubBehavior(ttft_s=0.005, itl_s=0.001)) as stub:
        assert _run(stub.url, "--num-prompts", str(n), "--request-rate", str(rate), "--warmup", "0",
                    "--seed", "3", "--output-json", str(out)) == 0
        # Arrivals are perf_counter() readings in the stub's own process: only their differences are used here
        # (on Linux both processes read one CLOCK_MONOTONIC, so even the values would compare with start_s's).
        server_gaps = np.diff(stub.state.arrivals)
    reqs = _load(out)["requests"]
    sched = np.array([r["scheduled_s"] for r in reqs])
    start = np.array([r["start_s"] for r in reqs])
    assert np.allclose(sched, arrival_offsets(n, rate, seed=3))
    assert np.all(start - sched < 0.02) and np.all(start - sched > -0.001)  # sent on time, never early
    # The server sees the same gaps, and their mean is near 1/rate (30 gaps of an exponential: within 35 %).
    assert server_gaps.mean() == pytest.approx(np.diff(sched).mean(), abs=0.005)
    assert server_gaps.mean() == pytest.approx(1 / rate, rel=0.35)


def test_connections_are_reused_and_chunks_are_not_held_back(tmp_path):
    # The client reads each body to its end after data: [DONE], so its connection goes back to the pool; one closed
    # mid-body would put a TCP connect into the next request's TTFT. With nothing injected, TTFT is the loopback's
    # cost alone: milliseconds, where a stub socket without TCP_NODELAY holds the first token behind the role
    # chunk until the client's delayed ACK (40 ms).
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=0.0, itl_s=0.0)) as stub:
        assert _run(stub.url, "--num-prompts", "6", "--max-concurrency", "2", "--warmup", "2",
                    "--output-json", str(out)) == 0
        state = stub.state
    assert len(state.bodies) == 8 and len(set(state.client_ports)) <= 2  # 2 connections, opened by the warm-up
    assert _load(out)["summary"]["ttft_ms"]["median"] < 25


def test_a_body_held_open_after_done_is_not_a_failure(tmp_path):
    # After data: [DONE] the client waits only briefly for the body's end: a server that keeps it open costs that
    # connection, not the request (without the bound, the 0.8 s request timeout would fail both).
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=0.01, itl_s=0.001, hold_open_s=1.0)) as stub:
        assert _run(stub.url, "--num-prompts", "2", "--warmup", "0", "--timeout", "0.8",
                    "--output-json", str(out)) == 0
    for r in _load(out)["requests"]:
        assert r["success"] and r["e2e_s"] < 0.3 and r["end_s"] - r["start_s"] < 0.8


def test_concurrency_warmup_and_duration(tmp_path):
    out = tmp_path / "run.json"
    with StubServer(StubBehavior(ttft_s=0.1, itl_s=0.005)) as stub:
        assert _run(stub.url, "--num-prompts", "6", "--max-concurrency", "2", "--warmup", "2",
                    "--output-json", str(out)) == 0
        assert stub.state.peak_in_flight <= 2 and len(stub.state.bodies) == 8
    doc = _load(out)
    assert len(doc["requests"]) == 6 and len(doc["warmup_requests"]) == 2
    assert doc["summary"]["peak_concurrent_requests"] == 2
    assert [r["index"] for r in doc["requests"]] == list(range(6))

    with StubServer(StubBehavior(ttft_s=0.01, itl_s=0.001)) as stub:
        assert _run(stub.url, "--num-prompts", "200", "--request-rate", "20", "--duration", "0.5",
                    "--warmup", "0", "--output-json", str(out)) == 0
    s = _load(out)["summary"]
    assert s["stopped_by"] == "duration" and 3 <= s["successful_requests"] <= 25
    assert s["successful_requests"] + s["not_issued_requests"] == 200


def test_model_is_discovered_and_base_url_may_end_in_v1():
    assert chat_url("http://h:1/v1/", "/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1", "/v1/chat/completions") == "http://h:1/v1/chat/completions"
    with StubServer(StubBehavior(ttft_s=0.0, itl_s=0.0), model="served-name") as stub:
        assert main(["--base-url", stub.url + "/v1", *SMALL, "--num-prompts", "1", "--warmup", "0"]) == 0
        assert stub.state.bodies[0]["model"] == "served-name"
        url = stub.url
    with pytest.raises(httpx.ConnectError):  # the stub's process is gone with its port
        httpx.get(url + "/v1/models", trust_env=False)
    with pytest.raises(RuntimeError):
        stub.url


def _decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_random_mm_dataset_is_seeded():
    opts = DatasetOptions(name="random-mm", seed=5, input_len=20, output_len=7, image_sizes=((40, 30), (24, 24)),
                          images_per_request=2, range_ratio=0.5)
    a, b = build_requests(opts, 6), build_requests(opts, 6)
    assert a == b
    assert a != build_requests(DatasetOptions(**{**opts.__dict__, "seed": 6}), 6)
    for r in a:
        parts = r.messages[0]["content"]
        assert r.num_images == 2 and [p["type"] for p in parts] == ["image_url", "image_url", "text"]
        assert {_decode(p["image_url"]["url"]).size for p in parts[:2]} <= {(40, 30), (24, 24)}
        assert 10 <= r.text_tokens <= 30 and r.text_tokens == len(parts[2]["text"].split())
        assert 3 <= r.max_completion_tokens <= 10


def test_shared_prefix_dataset():
    opts = DatasetOptions(name="shared-prefix", seed=0, shared_fraction=0.4, prefix_len=16, input_len=5,
                          image_sizes=((16, 16),))
    reqs = build_requests(opts, 10)
    assert reqs == build_requests(opts, 10)
    shared = [r for r in reqs if r.group == "shared"]
    unique = [r for r in reqs if r.group == "unique"]
    assert len(shared) == 4 and len(unique) == 6
    prefix = lambda r: (r.messages[0]["content"], r.messages[1]["content"][0]["image_url"]["url"])  # noqa: E731
    assert len({prefix(r) for r in shared}) == 1  # one system prompt and one image, reused
    assert len({prefix(r) for r in unique} | {prefix(shared[0])}) == 7  # everything else is distinct
    assert len({r.messages[1]["content"][1]["text"] for r in reqs}) == 10  # every question differs


def test_image_dir_dataset_and_one_liner(photo_paths, tmp_path):
    folder = str(next(iter(photo_paths.values())).parent)
    opts = DatasetOptions(name="image-dir", seed=1, image_dir=folder, output_len=4)
    reqs = build_requests(opts, 8)
    assert reqs == build_requests(opts, 8)
    assert {r.group for r in reqs} <= {p.name for p in photo_paths.values()}
    assert all(r.messages[0]["content"][0]["image_url"]["url"].startswith("data:image/") for r in reqs)
    # The shape of the lead's end-to-end test against `epdserve launch`.
    with StubServer(StubBehavior(ttft_s=0.01, itl_s=0.002)) as stub:
        assert main(["--base-url", stub.url, "--model", "stub-model", "--dataset", "image-dir",
                     "--image-dir", folder, "--num-prompts", "4", "--output-len", "4", "--disable-tqdm"]) == 0


def test_tokenizer_gives_exact_lengths(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    maker = TextMaker(tmp_path)  # a checkpoint-style directory holding tokenizer.json
    text = maker.text(np.random.default_rng(0), 37)
    assert maker.exact and maker.count(text) == 37


def test_jsonl_dataset(tmp_path, photo_paths):
    photo = next(iter(photo_paths.values()))
    lines = [
        {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "temperature": 0.5},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": str(photo)}}, {"type": "text", "text": "what is it"}]}]}},
    ]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = build_requests(DatasetOptions(name="jsonl", jsonl_path=str(path), output_len=9), 3)
    assert [r.max_completion_tokens for r in reqs] == [3, 9, 3]  # file order, cycled
    assert reqs[0].extra == {"temperature": 0.5} and reqs[0].text_tokens == 2
    assert reqs[1].group == "req-2" and reqs[1].num_images == 1
    assert reqs[1].messages[0]["content"][0]["image_url"]["url"].startswith("data:image/")
    with StubServer(StubBehavior(ttft_s=0.0, itl_s=0.0)) as stub:
        assert main(["--base-url", stub.url, "--dataset", "jsonl", "--jsonl", str(path), "--num-prompts", "2",
                     "--disable-tqdm"]) == 0
        bodies = stub.state.bodies
    assert len(bodies) == 3 and all(b["model"] == "stub-model" for b in bodies)  # discovered, not the line's "x"
    assert sorted(b["max_completion_tokens"] for b in bodies) == [3, 3, 128]  # --output-len default for line 2
    assert sorted(b.get("temperature", 0) for b in bodies) == [0, 0.5, 0.5]  # lines 1, 2, 1 (warm-up first)


def test_sweep_writes_one_plot_and_json(tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with StubServer(StubBehavior(ttft_s=0.02, itl_s=0.005)) as stub:
        rc = main(["sweep", "--base-url", stub.url, "--model", "stub-model", *SMALL, "--request-rates", "20,inf",
                   "--num-prompts", "5", "--output-json", str(out), "--plot", str(png)])
    assert rc == 0
    doc = _load(out)
    assert doc["schema"] == "epdserve.bench.sweep/1" and doc["config"]["request_rates"] == [20.0, "inf"]
    assert [run["summary"]["request_rate"] for run in doc["runs"]] == [20.0, "inf"]
    assert [run["config"]["seed"] for run in doc["runs"]] == [0, 1]
    assert all(len(run["requests"]) == 5 for run in doc["runs"])
    with Image.open(png) as im:
        im.verify()


def test_cli_usage():
    assert main(["--help"]) == 0
    assert main(["sweep", "--help"]) == 0
    assert main(["--base-url", "http://x", "--dataset", "nope"]) == 2
    assert main(["--base-url", "http://x", "--model", "m", "--slo", "ttft:5"]) == 2
    assert parse_slo("ttft=500, tpot=50,e2e=2000") == {"ttft": 500.0, "tpot": 50.0, "e2e": 2000.0}
    proc = subprocess.run([sys.executable, "-m", "epdserve.bench", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--request-rate" in proc.stdout


def test_gateway_benchmark_against_a_synthetic_decode(tmp_path, tiny_model_path, capsys):
    # The gateway keeps up with 4 streams at one token per 20 ms each: every token arrives, and the median gap
    # between tokens is the synthetic decode step (merging queued outputs only happens when it falls behind).
    from epdserve.bench.gateway import main as gateway_bench

    out = tmp_path / "gw.json"
    assert gateway_bench(["--model-path", tiny_model_path, "--concurrency", "4", "--step-ms", "20",
                          "--output-len", "12", "--rounds", "1", "--output-json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["failed"] == 0 and row["concurrency"] == 4 and row["offered_tok_s"] == 200
    assert 15 <= row["itl_median_ms"] <= 30
    assert row["gateway_cpu_ms_per_1k_tokens"] > 0
    assert "delivered" in capsys.readouterr().out


def test_random_video_dataset_sends_distinct_real_clips_of_the_asked_shape(tmp_path):
    """random-video: one video_url part per request, an MP4 of the asked size, frame count and rate that PyAV
    reads back; the same seed gives the same clips, and no two requests share a clip (no cache can hit)."""
    import base64

    from epdserve.bench.datasets import DatasetOptions, build_requests
    from epdserve.video import probe_video

    opts = DatasetOptions(name="random-video", seed=3, input_len=8, output_len=4, video_size=(96, 64),
                          video_frames=6, video_fps=3.0)
    reqs = build_requests(opts, 3)
    urls = [r.messages[0]["content"][0]["video_url"]["url"] for r in reqs]
    assert all(r.num_videos == 1 and r.num_images == 0 for r in reqs)
    assert all(u.startswith("data:video/mp4;base64,") for u in urls) and len(set(urls)) == 3
    meta = probe_video(base64.b64decode(urls[0].split(",", 1)[1]))
    assert (meta.width, meta.height, meta.total_num_frames, meta.fps) == (96, 64, 6, 3.0)
    again = build_requests(opts, 3)
    assert [r.messages for r in again] == [r.messages for r in reqs]
    with pytest.raises(ValueError, match="even width and height"):
        build_requests(DatasetOptions(name="random-video", video_size=(95, 64)), 1)


def test_video_dir_dataset_reads_the_files(tmp_path):
    from epdserve.bench.datasets import DatasetOptions, build_requests
    from epdserve.bench.synth import random_video

    rng = np.random.default_rng(0)
    (tmp_path / "a.mp4").write_bytes(random_video(rng, 64, 48, 4, 2.0))
    (tmp_path / "notes.txt").write_text("not a video")
    reqs = build_requests(DatasetOptions(name="video-dir", video_dir=str(tmp_path)), 2)
    assert {r.group for r in reqs} == {"a.mp4"}
    assert reqs[0].messages[0]["content"][0]["video_url"]["url"].startswith("data:video/mp4;base64,")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_requests(DatasetOptions(name="video-dir", video_dir=str(tmp_path / "missing")), 1)
    (tmp_path / "a.mp4").unlink()
    with pytest.raises(FileNotFoundError, match="no files"):
        build_requests(DatasetOptions(name="video-dir", video_dir=str(tmp_path)), 1)


def test_output_lens_replayed_from_an_earlier_run(tmp_path):
    # A JSON schema ends outputs early; the plain run of an A/B asks each request for the count it got there.
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    with StubServer(StubBehavior()) as stub:
        assert _run(stub.url, "--num-prompts", "4", "--warmup", "1", "--output-json", str(first)) == 0
        doc = _load(first)
        got = [6, 3, 1, 7, 2]  # as a constrained run would have them: the warm-up's first, then by index
        doc["warmup_requests"][0]["completion_tokens"] = got[0]
        for r in doc["requests"]:
            r["completion_tokens"] = got[1 + r["index"]]
        first.write_text(json.dumps(doc))
        n0 = len(stub.state.bodies)
        assert _run(stub.url, "--num-prompts", "4", "--warmup", "1", "--output-lens-from", str(first),
                    "--output-json", str(second)) == 0
        sent = [b["max_completion_tokens"] for b in stub.state.bodies[n0:]]
    assert sorted(sent) == sorted(got) and sent[0] == got[0]  # the warm-up goes first; the rest by concurrency
    assert sorted(r["completion_tokens"] for r in _load(second)["requests"]) == sorted(got[1:])
    doc["requests"][2]["completion_tokens"] = None  # a failed request has no count to replay
    reqs = build_requests(DatasetOptions(name="random-mm", seed=0, input_len=8, output_len=8,
                                         image_sizes=((32, 32),)), 5)
    with pytest.raises(ValueError, match="no completed request at position"):
        with_output_lens(reqs, doc)
