"""Several prefill and decode servers behind one gateway (issue 48), against fake servers (tests/test_gateway.py's
``FakeStage``: ZeroMQ ROUTERs that record what they get) and a fake encoder: where each request is placed, what the
encoder and decode are told of the chosen prefill server, and what happens when one server goes down. The same
through real servers (`epdserve launch` with two of each, TP=2 on one of each) is tests/test_launch_multi.py.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time

import httpx
import pytest
from test_gateway import (FakeEncoder, FakeStage, _photo_content, _wait_for, default_script, hang_script,
                          running_gateway)

from epdserve.config import GatewayConfig, LaunchConfig, add_config_args, config_from_args
from epdserve.gateway.stages import GatewayStages
from epdserve.wire.messages import AbortRequest, DecodeRequest, PrefillRequest

# Long enough that a repeated prompt's cached prefix (whole 16-token pages) is well over the 0.3 threshold.
STORY = "Tell me a long story about a rocket, a cat and the moon, with many details about each of them. " * 3


@pytest.fixture(scope="module")
def fakes():
    """Two fake prefill servers (each with its own embedding endpoints and bootstrap port) and two fake decodes."""
    prefills = [FakeStage("prefill"), FakeStage("prefill")]
    for i, p in enumerate(prefills):
        p.embed_endpoints = [f"tcp://127.0.0.1:{39200 + 10 * i + r}" for r in range(2)]
        p.bootstrap_port = 38900 + i
    decodes = [FakeStage("decode"), FakeStage("decode")]
    yield prefills, decodes
    for stage in prefills + decodes:
        stage.stop()


@pytest.fixture(scope="module")
def gateway(tiny_model_path, processor, fakes):
    prefills, decodes = fakes
    config = GatewayConfig(model_path=tiny_model_path, prefill_addr=",".join(p.addr for p in prefills),
                           decode_addr=[d.addr for d in decodes], heartbeat_interval_s=0.2, stage_timeout_s=2.0)
    encoder = FakeEncoder(processor)
    stages = GatewayStages(config, encoder=encoder)
    with running_gateway(config, stages) as base:
        assert _wait_for(lambda: all(s.up for s in stages.servers), 10)
        yield base, stages, encoder


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path)


def _quiet(fakes) -> None:
    """Wait until the fakes have been quiet for a moment (answers of the previous test still landing), then clear
    what they recorded."""
    stages = [*fakes[0], *fakes[1]]
    seen = -1
    while seen != (seen := sum(len(s.received) for s in stages)):
        time.sleep(0.1)
    for s in stages:
        s.reset()


def _where(fakes, kind: type, rid: str) -> list[int]:
    """Indices of the fakes (prefills for PrefillRequest, decodes otherwise) that got ``kind`` for ``rid``."""
    group = fakes[0] if kind is PrefillRequest else fakes[1]
    return [i for i, s in enumerate(group) if any(m.rid == rid for m in s.messages(kind))]


def _post(base: str, model: str, content, rid: str, timeout: float | httpx.Timeout = 30.0) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_completion_tokens": 3}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}, timeout=timeout)


def test_prompts_go_where_their_prefix_is_cached_and_decode_learns_that_prefill(gateway, fakes, tiny_model_path,
                                                                               photo_paths):
    base, stages, encoder = gateway
    prefills, decodes = fakes
    _quiet(fakes)
    placed = {}
    for name, content in (("story", STORY), ("other", "Say something short and new about the sea, please.")):
        assert _post(base, tiny_model_path, content, f"first-{name}").status_code == 200
        assert _wait_for(lambda: len(_where(fakes, PrefillRequest, f"first-{name}")) == 1)
        placed[name] = _where(fakes, PrefillRequest, f"first-{name}")[0]
    assert sorted(placed.values()) == [0, 1]  # a new prompt goes to the server with the least cached
    for name, content in (("story", STORY), ("other", "Say something short and new about the sea, please.")):
        for turn in range(2):  # the same prompt again: where its prefix is
            rid = f"again-{name}-{turn}"
            assert _post(base, tiny_model_path, content, rid).status_code == 200
            assert _wait_for(lambda: _where(fakes, PrefillRequest, rid) == [placed[name]])
    # Every DecodeRequest names the bootstrap address of the prefill server its request went to; decode is the
    # idle one with the lowest index (the requests ran one at a time).
    for rid in ("first-story", "again-story-0", "first-other", "again-other-1"):
        (req,) = [m for m in decodes[0].messages(DecodeRequest) if m.rid == rid]
        (pre,) = _where(fakes, PrefillRequest, rid)
        assert req.bootstrap_port == prefills[pre].bootstrap_port
    assert not decodes[1].messages(DecodeRequest)
    # An image request: the encoder pushes to every TP rank of the chosen prefill server, and only there.
    encoder.calls.clear()
    assert _post(base, tiny_model_path, _photo_content(photo_paths["chelsea"]), "photo").status_code == 200
    assert _wait_for(lambda: len(_where(fakes, PrefillRequest, "photo")) == 1)
    (pre,) = _where(fakes, PrefillRequest, "photo")
    assert encoder.calls == [("photo", 1, prefills[pre].embed_endpoints)]
    assert _wait_for(lambda: not stages.num_inflight and all(not s.rids for s in stages.servers))


def _held(base: str, model: str, rid: str, give_up_s: float, results: dict) -> threading.Thread:
    """A request on a hanging fake decode, in a thread whose client gives up after ``give_up_s`` seconds without a
    byte (the gateway then aborts the request at its servers); its response, or None, lands in ``results[rid]``."""
    def run() -> None:
        try:
            results[rid] = _post(base, model, f"Hold {rid}.", rid, timeout=httpx.Timeout(30, read=give_up_s))
        except httpx.TimeoutException:
            results[rid] = None

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_decode_by_requests_in_flight(gateway, fakes, tiny_model_path):
    base, stages, _ = gateway
    _, decodes = fakes
    _quiet(fakes)
    decodes[0].script = hang_script  # its requests run until aborted
    try:
        held = _held(base, tiny_model_path, "held", 3.0, {})
        assert _wait_for(lambda: _where(fakes, DecodeRequest, "held") == [0])
        for i in range(3):  # decode 0 has one running: each of these goes to decode 1 (they finish at once)
            assert _post(base, tiny_model_path, f"Quick {i}.", f"quick{i}").status_code == 200
            assert _where(fakes, DecodeRequest, f"quick{i}") == [1]
        health = httpx.get(f"{base}/health", params={"details": 1}, timeout=5).json()
        assert [s["inflight"] for s in health["stages"]["decode"]] == [1, 0]
        held.join(30)
    finally:
        decodes[0].script = default_script
    # The client gave up: the gateway aborted the request at both of its servers and forgot it.
    assert _wait_for(lambda: _where(fakes, AbortRequest, "held") == [0])
    assert _wait_for(lambda: not stages.num_inflight and all(not s.rids for s in stages.servers))


def test_a_decode_server_going_down_fails_only_its_requests(gateway, fakes, tiny_model_path):
    """Decode 1 stops while a request hangs on each decode server: its request ends with a 503 naming it, the one
    on decode 0 runs on, /health lists decode 1 down (still 200: decode 0 serves), and new requests go to decode
    0. Last in the module: decode 1 stays down."""
    base, stages, _ = gateway
    _, decodes = fakes
    _quiet(fakes)
    results: dict = {}
    for d in decodes:
        d.script = hang_script
    try:
        on0 = _held(base, tiny_model_path, "on0", 6.0, results)
        assert _wait_for(lambda: _where(fakes, DecodeRequest, "on0") == [0])
        on1 = _held(base, tiny_model_path, "on1", 30.0, results)
        assert _wait_for(lambda: _where(fakes, DecodeRequest, "on1") == [1])
        decodes[1].stop()
        on1.join(10)
        err = results["on1"]
        assert err is not None and err.status_code == 503 and err.headers.get("retry-after"), err
        message = err.json()["error"]["message"]
        assert "decode server 1" in message and "went down" in message, message
        assert on0.is_alive()  # the request on decode 0 is untouched
        health = httpx.get(f"{base}/health", params={"details": 1}, timeout=5)
        assert health.status_code == 200
        listed = health.json()["stages"]
        assert [(s["index"], s["up"]) for s in listed["decode"]] == [(0, True), (1, False)]
        assert [s["up"] for s in listed["prefill"]] == [True, True] and listed["decode"][1]["reason"]
        on0.join(30)
        assert results["on0"] is None  # it hung until its client gave up, not failed by decode 1's end
    finally:
        decodes[0].script = default_script
    assert _post(base, tiny_model_path, "Still there?", "after").status_code == 200
    assert _where(fakes, DecodeRequest, "after") == [0]
    assert _wait_for(lambda: not stages.num_inflight and all(not s.rids for s in stages.servers))


# ---------------------------------------------------------------------------------------------------- config

def test_server_lists_from_flags_and_bad_input():
    parser = argparse.ArgumentParser()
    add_config_args(parser, GatewayConfig)
    cfg = config_from_args(GatewayConfig, parser.parse_args(
        ["--prefill-addr", "tcp://a:1", "--prefill-addr", "tcp://b:2,tcp://c:3", "--decode-addr", "tcp://d:4"]))
    assert cfg.prefill_addr == ["tcp://a:1", "tcp://b:2", "tcp://c:3"] and cfg.decode_addr == ["tcp://d:4"]
    assert GatewayConfig(prefill_addr="tcp://a:1, tcp://b:2").prefill_addr == ["tcp://a:1", "tcp://b:2"]
    with pytest.raises(ValueError, match="names a server twice"):
        GatewayConfig(decode_addr="tcp://d:4,tcp://d:4")
    with pytest.raises(ValueError, match="at least one"):
        GatewayConfig(prefill_addr=",")
    launch = argparse.ArgumentParser()
    add_config_args(launch, LaunchConfig)
    cfg = config_from_args(LaunchConfig, launch.parse_args(["--num-prefills", "2", "--prefill-tp", "2,1",
                                                            "--prefill-gpus", "0,2", "--num-decodes", "3"]))
    assert cfg.per_server("prefill_tp") == [2, 1] and cfg.per_server("prefill_gpus") == [0, 2]
    assert cfg.per_server("decode_tp") == [1, 1, 1] and cfg.per_server("encoder_gpus") == [0]
    with pytest.raises(ValueError, match="--decode-gpus has 2 values for 3 decode"):
        LaunchConfig(num_decodes=3, decode_gpus=[0, 1]).per_server("decode_gpus")
    with pytest.raises(ValueError, match="--prefill-tp values must be at least 1"):
        LaunchConfig(prefill_tp=0).per_server("prefill_tp")
    with pytest.raises(ValueError, match="--num-decodes must be at least 1"):
        LaunchConfig(num_decodes=0)
    with pytest.raises(SystemExit):
        launch.parse_args(["--prefill-gpus", "0,x"])


def test_launch_plan_gives_each_server_its_ports_and_gpus():
    from epdserve.entry.launch_plan import plan_launch

    cfg = LaunchConfig(num_encoders=2, num_prefills=2, num_decodes=2, prefill_tp=[2, 1], decode_tp=2,
                       encoder_gpus=[3], prefill_gpus=[0, 2], decode_gpus=[4, 6])
    plan = plan_launch(cfg, "/models/m", on_gpus=True)
    assert list(plan.commands) == ["encoder0", "encoder1", "prefill0", "prefill1", "decode0", "decode1", "gateway"]
    assert plan.gpus == {"encoder0": [3], "encoder1": [3], "prefill0": [0, 1], "prefill1": [2], "decode0": [4, 5],
                         "decode1": [6, 7]}

    def flag(name: str, key: str) -> str:
        return plan.commands[name][plan.commands[name].index(key) + 1]

    ports = [int(flag(n, k)) for n in plan.commands if n != "gateway" for k in
             ("--port", "--zmq-port", "--embed-port", "--bootstrap-port", "--kv-port", "--metrics-port")
             if k in plan.commands[n] and flag(n, k) != "0"]
    assert len(ports) == len(set(ports)) == 2 * 2 + 4 * 2 + 3 * 2  # none shared
    assert flag("gateway", "--prefill-addr").split(",") == [f"tcp://127.0.0.1:{flag(n, '--zmq-port')}"
                                                            for n in ("prefill0", "prefill1")]
    assert flag("gateway", "--decode-addr").split(",") == [f"tcp://127.0.0.1:{flag(n, '--zmq-port')}"
                                                           for n in ("decode0", "decode1")]
    assert (flag("prefill0", "--tp"), flag("prefill0", "--base-gpu-id"), flag("prefill1", "--tp")) == ("2", "0", "1")
    assert flag("encoder1", "--device") == "cuda:3"
    on_cpu = plan_launch(LaunchConfig(device="cpu", num_prefills=2), "/models/m", on_gpus=False)
    assert on_cpu.gpus == {} and list(on_cpu.commands)[1:3] == ["prefill0", "prefill1"]
    assert on_cpu.commands["encoder0"][on_cpu.commands["encoder0"].index("--device") + 1] == "cpu"


def test_launch_never_draws_the_gateways_own_ports(monkeypatch):
    """The gateway binds ``--port`` and ``--kserve-grpc-port`` after the stages' ports are drawn, so the draw skips
    them even when they are free at that moment (CI: a decode's metrics port drawn equal to the gateway's, its
    /metrics lost). The random draw is scripted to offer both first; the fallback to ephemeral ports skips them too."""
    from epdserve.entry.launch_plan import plan_launch
    from epdserve.wire import ports

    gateway, kserve = ports.free_ports(2)  # free now: the draw would take them if it did not skip them
    offered = iter([gateway, kserve] * 3 + list(range(10_000, 30_000)))

    class Scripted:
        def randrange(self, lo: int, hi: int) -> int:
            return next(p for p in offered if lo <= p < hi)

    monkeypatch.setattr(ports.random, "SystemRandom", Scripted)
    plan = plan_launch(LaunchConfig(device="cpu", port=gateway, kserve_grpc_port=kserve), "/models/m", on_gpus=False)
    drawn = {int(c[c.index(k) + 1]) for n, c in plan.commands.items() if n != "gateway"
             for k in ("--port", "--zmq-port", "--embed-port", "--bootstrap-port", "--kv-port", "--metrics-port")
             if k in c}
    assert gateway not in drawn and kserve not in drawn and len(drawn - {0}) == 2 + 4 + 3
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 10_000)  # no range below: ephemeral ports only
    assert not {gateway, kserve} & set(ports.free_ports(50, exclude={gateway, kserve}))


def test_launch_stops_the_gateway_before_the_stages():
    """On Ctrl-C the launcher stops the gateway alone first (so it neither sends new work nor logs the stages'
    going away as failures), then the stages; a stage that ignores SIGTERM is killed at the grace deadline."""
    from epdserve.entry.launch import _stop
    from epdserve.entry.launch_plan import plan_launch

    plan = plan_launch(LaunchConfig(device="cpu"), "/models/m", on_gpus=False)
    events: list[str] = []

    class Proc:
        def __init__(self, name: str, obeys: bool = True, exit_after_s: float = 0.0):
            self.name, self.obeys, self.exit_after_s, self.stopped_at = name, obeys, exit_after_s, None

        def poll(self):
            done = self.stopped_at is not None and time.monotonic() >= self.stopped_at
            return 0 if done else None

        def send_signal(self, sig):
            events.append(f"TERM {self.name}")
            if self.obeys:
                self.stopped_at = time.monotonic() + self.exit_after_s

        def wait(self, timeout=None):
            if self.stopped_at is None:
                time.sleep(timeout)
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(max(0.0, self.stopped_at - time.monotonic()))
            events.append(f"exit {self.name}")
            return 0

        def kill(self):
            events.append(f"KILL {self.name}")
            self.stopped_at = time.monotonic()

    procs = {name: Proc(name, exit_after_s=0.2 if name == "gateway" else 0.0) for name in plan.commands}
    stages = [*plan.names("encoder"), *plan.names("prefill"), *plan.names("decode")]
    decode = plan.names("decode")[0]
    procs[decode] = Proc(decode, obeys=False)
    _stop(procs, plan, grace_s=1.0)
    assert events[:2] == ["TERM gateway", "exit gateway"]  # the stages hear nothing until the gateway is gone
    assert events[2:5] == [f"TERM {name}" for name in stages] and len(stages) == 3
    assert [e for e in events if e.startswith("KILL")] == [f"KILL {decode}"]  # at the deadline, the others exited
