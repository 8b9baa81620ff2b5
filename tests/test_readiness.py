"""Ready means ready: nothing calls itself ready before the encoders serve.

- A gateway started while its encoder is still loading answers ``/health`` 503 (naming the encoder) until the
  encoder's gRPC health says SERVING, then 200; ``/health/live`` is 200 throughout, and text requests are served
  meanwhile.
- ``epdserve launch`` with an encoder that is slow to start logs its ready line only after the encoder serves, and an
  image request sent the moment the line appears succeeds.

The encoder's slow start is ``EPDSERVE_TEST_ENCODER_LOAD_DELAY_S`` (``epdserve.encoder.server.LOAD_DELAY_ENV``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from cluster import body, health, noise_png, serve_gateway, wait_for

from epdserve.encoder.server import LOAD_DELAY_ENV
from epdserve.wire.ports import free_port

LOAD_DELAY_S = 8.0


def _encoder_serving(addr: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _chat(base: str, req: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=req, timeout=120)


def test_gateway_health_waits_for_a_loading_encoder(stage_procs, tiny_model_path, tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    log = open(tmp_path / "encoder.log", "w")
    enc = subprocess.Popen([sys.executable, "-m", "epdserve", "encoder", "--model-path", tiny_model_path,
                            "--device", "cpu", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, LOAD_DELAY_ENV: str(LOAD_DELAY_S), "OMP_NUM_THREADS": "1"})
    try:
        with serve_gateway(stage_procs.gateway_config(encoder_addr=addr), wait_healthy=False) as (base, _):
            assert wait_for(lambda: httpx.get(f"{base}/health", timeout=2).status_code == 503 and
                            "encoder" in httpx.get(f"{base}/health", timeout=2).json()["error"]["message"], 60)
            assert not _encoder_serving(addr)
            # Meanwhile: alive, serving text, refusing images with 503.
            assert health(base, "/health/live") == 200
            text = _chat(base, body(tiny_model_path, "Say something.", max_tokens=4))
            assert text.status_code == 200, text.text
            assert len(text.json()["choices"][0]["token_ids"]) == 4
            image = _chat(base, body(tiny_model_path, "What is this?", image=noise_png(34_001), max_tokens=4))
            assert image.status_code == 503, image.text
            assert health(base) == 503 and not _encoder_serving(addr)
            # Ready once the encoder serves (and not before: its health, once SERVING, stays so).
            assert wait_for(lambda: health(base) == 200, 120, every_s=0.1), (tmp_path / "encoder.log").read_text()
            assert _encoder_serving(addr)
            assert health(base, "/health/live") == 200
            image = _chat(base, body(tiny_model_path, "What is this?", image=noise_png(34_002), max_tokens=4))
            assert image.status_code == 200, image.text
    finally:
        enc.kill()
        enc.wait()
        log.close()


def test_launch_is_ready_only_once_a_slow_encoder_serves(tiny_model_path, tmp_path):
    port = free_port()
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epdserve", "--log-level", "INFO", "launch", "--model-path", tiny_model_path,
             "--port", str(port), "--num-encoders", "2"], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", LOAD_DELAY_ENV: str(LOAD_DELAY_S)})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while "epdserve ready on" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"launch did not get ready:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        # The moment the ready line appears: an image request goes through.
        r = _chat(base, body(tiny_model_path, "What is this?", image=noise_png(34_003), max_tokens=4))
        assert r.status_code == 200, r.text
        text = log_path.read_text()
        ready_at = text.index("epdserve ready on")
        encoders_ready = [i for i in range(len(text)) if text.startswith("encoder ready on", i)]
        assert len(encoders_ready) == 2 and max(encoders_ready) < ready_at, text[-4000:]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]


def test_launch_names_a_stage_that_dies_before_ready(tiny_model_path, tmp_path):
    """Stages that cannot start (a dtype no stage knows) stop the launch with exit code 1, no ready line, and the
    dead stage's last log lines (its error) repeated by the launcher."""
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epdserve", "--log-level", "INFO", "launch", "--model-path", tiny_model_path,
             "--port", str(free_port()), "--dtype", "float7"], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        code = proc.wait(timeout=120)
    text = log_path.read_text()
    assert code == 1, text[-3000:]
    assert "epdserve ready on" not in text
    tail = text[text.index("before every stage served"):]
    assert "last lines of" in tail and "unknown dtype 'float7'" in tail, text[-3000:]


def test_launch_refuses_a_port_another_server_listens_on(tiny_model_path, tmp_path):
    """A launch whose --port is taken exits 1 at once, naming the port, and starts no stage: its ready check would
    otherwise take the other server's /health for its own gateway's."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "epdserve", "launch", "--model-path", tiny_model_path, "--port",
                              str(port)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr[-3000:]
    assert f"port {port} on 127.0.0.1 is in use" in run.stderr
    assert "ready on" not in run.stderr  # no stage started
