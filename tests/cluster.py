"""Test helpers: the three stage servers as real processes that tests can kill, stop and restart, and gateways
(in-process, uvicorn in a thread) in front of them.

Ports are picked once, so a restarted stage comes back at the same address and the gateway must take it back
without a restart of its own.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from epdserve.config import GatewayConfig
from epdserve.wire.ports import free_port, free_ports

READY = {"encoder": "encoder ready on", "prefill": "prefill ready on", "decode": "decode ready on"}


class StageProcs:
    """Encoder, prefill and decode servers as subprocesses on fixed free ports, logging to ``log_dir``.

    Args:
        model_path: the checkpoint every stage loads.
        log_dir: one log file per stage (appended to across restarts).
        num_pages: KV pages of prefill and of decode (small, so that tests can fill the pool).
        lm_args: more flags for prefill and decode (e.g. ``("--kv-transfer", "shared")``).
    """

    def __init__(self, model_path: str, log_dir: Path, num_pages: int = 256, page_size: int = 16,
                 request_timeout_s: float = 60.0, lm_args: tuple[str, ...] = ()):
        self.model_path, self.log_dir, self.lm_args = model_path, log_dir, tuple(lm_args)
        self.num_pages, self.page_size, self.request_timeout_s = num_pages, page_size, request_timeout_s
        names = ("encoder", "prefill", "embed", "bootstrap", "decode", "kv")
        self.ports = dict(zip(names, free_ports(len(names))))  # distinct: picked one by one they could repeat
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}

    @property
    def encoder_addr(self) -> str:
        return f"127.0.0.1:{self.ports['encoder']}"

    @property
    def prefill_addr(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['prefill']}"

    @property
    def decode_addr(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['decode']}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _command(self, name: str) -> list[str]:
        p = self.ports
        common = ["--model-path", self.model_path, "--device", "cpu"]
        lm = [*common, "--num-pages", str(self.num_pages), "--page-size", str(self.page_size),
              "--request-timeout-s", str(self.request_timeout_s), *self.lm_args]
        args = {
            "encoder": ["encoder", *common, "--port", str(p["encoder"]), "--max-message-mb", "16"],
            "prefill": ["prefill", *lm, "--port", "0", "--zmq-port", str(p["prefill"]),
                        "--embed-port", str(p["embed"]), "--bootstrap-port", str(p["bootstrap"])],
            "decode": ["decode", *lm, "--port", "0", "--zmq-port", str(p["decode"]), "--kv-port", str(p["kv"])],
        }[name]
        return [sys.executable, "-m", "epdserve", "--log-level", "INFO", *args]

    def start(self, *names: str) -> None:
        """Start the named stages (all three when none is named) and wait until each logs its ready line."""
        names = names or ("encoder", "prefill", "decode")
        marks = {}
        for name in names:
            path = self.log_path(name)
            marks[name] = path.read_text().count(READY[name]) if path.exists() else 0
            log = self._logs.get(name) or open(path, "a")
            self._logs[name] = log
            # One torch thread each: three servers and the test share two cores, and spinning OpenMP workers of
            # one server would starve the others.
            self.procs[name] = subprocess.Popen(self._command(name), stdout=log, stderr=subprocess.STDOUT,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 180
        for name in names:
            while self.log_path(name).read_text().count(READY[name]) <= marks[name]:
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start:\n{self.log_path(name).read_text()[-3000:]}")
                time.sleep(0.1)

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (no chance to clean up, as when a machine dies) and reap it."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process keeps its sockets open but answers nothing (a hung server)."""
        self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def stop_all(self) -> None:
        # Test servers hold nothing worth a graceful stop, but for the /dev/shm files of shared KV and state pools
        # (removed on a clean exit only).
        graceful = "shared" in self.lm_args
        for proc in self.procs.values():
            proc.terminate() if graceful else proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for log in self._logs.values():
            log.close()

    def gateway_config(self, **overrides) -> GatewayConfig:
        """A gateway config pointing at these stages, with the test's fast liveness settings."""
        fields = dict(model_path=self.model_path, encoder_addr=self.encoder_addr, prefill_addr=self.prefill_addr,
                      decode_addr=self.decode_addr, stage_timeout_s=2.0, heartbeat_interval_s=0.25)
        return GatewayConfig(**(fields | overrides))


@contextmanager
def serve_gateway(config: GatewayConfig, timeout_s: float = 60.0, *, wait_healthy: bool = True):
    """Serve a gateway for ``config`` with uvicorn on a free port in a thread; yield ``(base_url, app)`` once its
    ``/health`` answers 200 (``wait_healthy``), else as soon as it answers ``/health/live``."""
    import uvicorn

    from epdserve.gateway.app import create_app, server_config

    app = create_app(config, startup_timeout_s=timeout_s)
    server = uvicorn.Server(server_config(app, "127.0.0.1", free_port(), graceful_shutdown_s=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.config.port}"
    try:
        if not wait_for(lambda: health(base, "/health" if wait_healthy else "/health/live") == 200, timeout_s):
            raise RuntimeError(f"gateway at {base} did not become healthy")
        yield base, app
    finally:
        server.should_exit = True
        thread.join(15)


def wait_for(pred, timeout_s: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return False


def health(base: str, route: str = "/health") -> int | None:
    try:
        return httpx.get(f"{base}{route}", timeout=2).status_code
    except httpx.HTTPError:
        return None


def details(base: str, fresh: bool = True) -> dict:
    """The gateway's ``/health?details=1`` body."""
    return httpx.get(f"{base}/health", params={"details": 1, "fresh": int(fresh)}, timeout=5).json()


def stage(d: dict, role: str, index: int = 0) -> dict:
    """Server ``index``'s entry (``{"index", "addr", "up", "load"...}``) of ``role`` in a ``/health?details=1``
    body; ``{}`` when there is none."""
    servers = d.get("stages", {}).get(role, [])
    return servers[index] if index < len(servers) else {}


def at_baseline(d: dict) -> list[str]:
    """What in a ``/health?details=1`` body is not back at rest: requests, KV pages (other than the radix cache's),
    rooms, embeddings or linear-attention state slots held by a prefill or decode server (each of them; one that is
    down shows "no load"), and Encode calls in flight. Empty when everything is."""
    problems = []
    stages = d.get("stages", {})
    for role in ("prefill", "decode"):
        servers = stages.get(role, [])
        for server in servers:
            name = role if len(servers) == 1 else f"{role}{server['index']}"  # as launch names them
            if server.get("inflight"):
                problems.append(f"{name}: {server['inflight']} requests in flight at the gateway")
            load = server.get("load")
            if load is None:
                problems.append(f"{name}: no load")
                continue
            for key in ("num_running_reqs", "num_waiting_reqs", "rooms", "embeddings", "state_slots_used"):
                if load.get(key):
                    problems.append(f"{name}.{key}={load[key]}")
            if load["kv_pages_used"] != load["kv_pages_cached"]:
                problems.append(f"{name}: {load['kv_pages_used']} pages used, {load['kv_pages_cached']} cached")
    for enc in stages.get("encoders", []):
        load = enc.get("load") or {}
        if load.get("num_requests") or load.get("num_images_encoding"):
            problems.append(f"encoder {enc['addr']}: {load}")
    gw = d.get("gateway", {})
    if gw.get("inflight") or gw.get("queued") or gw.get("at_stages"):
        problems.append(f"gateway: {gw}")
    return problems


def noise_png(seed: int, size: int = 96) -> str:
    """A distinct random RGB PNG as a data URL (distinct images miss the encoder's and the radix cache)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, text: str, *, image: str | None = None, max_tokens: int = 16, stream: bool = False,
         **extra) -> dict:
    """A greedy chat request (EOS ignored, so it runs ``max_tokens``) with an optional image data URL."""
    content = text if image is None else [{"type": "image_url", "image_url": {"url": image}},
                                          {"type": "text", "text": text}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_completion_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, "stream": stream,
            **extra}


@dataclass
class StreamResult:
    """How one streamed request ended, as the client saw it."""

    status: int
    events: list  # parsed JSON chunks, "[DONE]", in order
    ended_at: float  # time.monotonic() when the response was over
    first_token_at: float | None = None

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, dict) and e.get("choices")
                for t in (e["choices"][0].get("token_ids") or [])]

    @property
    def finish_reason(self) -> str | None:
        return next((e["choices"][0]["finish_reason"] for e in self.events if isinstance(e, dict)
                     and e.get("choices") and e["choices"][0].get("finish_reason")), None)


def stream(base: str, req: dict, started: threading.Event | None = None, timeout_s: float = 120.0) -> StreamResult:
    """POST ``req`` (with ``stream: true``) and read the SSE stream to its end; ``started`` is set at the first
    content token. A non-200 answer gives its error body as the only event."""
    events = []
    first = None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**req, "stream": True},
                      timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            return StreamResult(r.status_code, [r.json()], time.monotonic())
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            if first is None and data != "[DONE]" and "choices" in events[-1] and events[-1]["choices"] and \
                    events[-1]["choices"][0].get("token_ids"):
                first = time.monotonic()
                if started is not None:
                    started.set()
    return StreamResult(200, events, time.monotonic(), first)
