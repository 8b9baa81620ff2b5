"""``epdserve launch``: ``--num-encoders`` encoders, ``--num-prefills`` prefill and ``--num-decodes`` decode servers
and the gateway as processes on one machine (:mod:`epdserve.entry.launch_plan`: their commands, ports and GPUs).

Internal servers bind 127.0.0.1 on free ports (their ``/metrics`` ports too); only the gateway takes
``--host``/``--port`` (it gets every encoder's, prefill's and decode's address) and serves its ``/metrics`` there.
Children log in the launcher's ``--log-level`` and ``--log-format``, through the launcher's stderr. The launcher
waits until the gateway's ``/health`` answers 200 and lists every server up (the gateway has then seen every
prefill and decode server, with all their TP ranks, answer, and every encoder's gRPC health say SERVING), logs one
ready line and one line of every process's ``/metrics`` URL, and on SIGINT/SIGTERM stops all. A child that dies
stops all too, except, once ready, a prefill or decode server while another of its role still runs: the gateway
has taken it out and the others serve on (logged as an error). A child that dies before the ready line is named
with its last log lines. Stages that share a GPU run under a CUDA MPS daemon of the launcher's own
(:mod:`epdserve.entry.mps`; ``--no-mps``: time-slicing).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from epdserve.config import LaunchConfig
from epdserve.cuda_probe import cuda_available
from epdserve.entry import mps
from epdserve.entry.launch_plan import LaunchPlan, plan_launch
from epdserve.logging_setup import process_age_s
from epdserve.models.paths import resolve_model_path
from epdserve.wire.ports import LOCAL as _LOCAL

log = logging.getLogger("epdserve.entry.launch")


def _on_gpus(cfg: LaunchConfig) -> bool:
    """Whether the stages go on GPUs by the placement flags (``--encoder-gpus``, ``--prefill-gpus``,
    ``--decode-gpus``): a ``cuda`` or ``auto`` device on a machine with CUDA."""
    return cfg.device in ("cuda", "auto") and cuda_available()  # without importing torch


def _gateway_ready(url: str, plan: LaunchPlan) -> bool:
    """True when the gateway's ``/health?details=1`` answers 200 and lists every encoder, prefill and decode server
    of ``plan``, every one up."""
    try:
        with urllib.request.urlopen(f"{url}?details=1", timeout=1) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):  # 503 (HTTPError is an OSError), refused, or a body that is not JSON
        return False
    stages = body.get("stages", {})
    for role, listed in (("encoder", "encoders"), ("prefill", "prefill"), ("decode", "decode")):
        servers = stages.get(listed, [])
        if len(servers) != len(plan.names(role)) or not all(s.get("up") for s in servers):
            return False
    return True


def _fatal(dead: dict[str, int], procs: dict[str, subprocess.Popen], plan: LaunchPlan, ready: bool) -> bool:
    """Whether the children in ``dead`` (name -> exit code) stop the launch: any before it was ready; after, any
    but a prefill or decode server with another of its role still running."""
    if not ready:
        return True
    for name in dead:
        role = plan.roles[name]
        if role not in ("prefill", "decode") or not any(procs[n].poll() is None for n in plan.names(role)):
            return True
    return False


class _LogTail:
    """Passes a child's stderr through to the launcher's and keeps its last ``lines`` lines, so that a stage
    that dies before the ready line can be named with what it said last."""

    def __init__(self, stream, lines: int = 20):
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            self.lines.append(raw.decode(errors="replace").rstrip())
        stream.close()

    def text(self) -> str:
        self._thread.join(timeout=1.0)  # the pipe closes when the process is gone: its last words are in
        return "\n".join(f"    {line}" for line in self.lines)


def torch_without_bytecode() -> str | None:
    """torch's package directory where this interpreter may not write bytecode (``PYTHONDONTWRITEBYTECODE``) and
    finds none for torch's ``__init__.py``, else None. Every stage then compiles torch's sources when it starts:
    2-3 s more per process on the H200 machine, whose image is built so (docs/performance.md, "2026-11-28, eighth
    session")."""
    spec = importlib.util.find_spec("torch") if sys.flags.dont_write_bytecode else None
    if spec is None or not spec.origin or os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    return os.path.dirname(spec.origin)


def port_in_use(host: str, port: int) -> bool:
    """Whether a socket listens on ``host:port``: a bind with ``SO_REUSEADDR`` (as uvicorn binds) fails. A port left
    in TIME_WAIT by a stopped server counts as free, as it does for uvicorn."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def launch(cfg: LaunchConfig, ready_timeout_s: float = 600.0) -> int:
    """Run the four servers until a signal or a child exits. Returns the exit code (0 after Ctrl-C; 1 at once when
    ``cfg.port`` is taken).

    A hub id ``--model-path`` is downloaded here, once (``epdserve launch`` has already done it: see
    :func:`epdserve.entry.cli._local_model`), and the stages get the local directory.

    Raises:
        ModelSourceError (a FileNotFoundError): ``cfg.model_path`` names no usable checkpoint.
        ValueError: a per-server flag with the wrong number of values (:func:`plan_launch`).
    """
    # From the process's start: the interpreter and the launcher's imports are part of the wait too.
    started = time.monotonic() - (process_age_s() or 0.0)
    if port_in_use(cfg.host, cfg.port):
        # Else the ready check below would take the other server's /health for the gateway's (seen on a device:
        # a launch started while the previous one was still stopping "was ready" in 0.3 s and served nothing).
        log.error("port %d on %s is in use: another server listens there (stop it, or pick --port)", cfg.port,
                  cfg.host)
        return 1
    # The default model built, a hub id downloaded, once, before the children race for it.
    model_path = resolve_model_path(cfg.model_path, cfg.revision)
    plan = plan_launch(cfg, model_path, _on_gpus(cfg))
    if (torch_dir := torch_without_bytecode()) is not None:
        log.warning("PYTHONDONTWRITEBYTECODE is set and torch has no bytecode: every stage compiles torch's sources "
                    "as it starts (seconds each); `python -m compileall -q %s` once removes that wait", torch_dir)
    procs: dict[str, subprocess.Popen] = {}
    tails: dict[str, _LogTail] = {}
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    daemon, mps_env = None, {}
    try:
        if plan.gpus:
            daemon, mps_env = mps.start_for(plan.gpus, cfg.mps)
        for name, cmd in plan.commands.items():
            # A new session keeps the terminal's Ctrl-C away from the children: the launcher stops them in order.
            env = os.environ | mps_env[name] if name in mps_env else None
            procs[name] = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, env=env)
            tails[name] = _LogTail(procs[name].stderr)
        health = f"http://{_LOCAL if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}/health"
        deadline, ready, lost = time.monotonic() + ready_timeout_s, False, set()
        while not stopping:
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None and n not in lost}
            if dead and not _fatal(dead, procs, plan, ready):
                log.error("%s exited; the other servers of its role serve on",
                          ", ".join(f"{n} (code {c})" for n, c in dead.items()))
                lost |= set(dead)
            elif dead:
                log.error("stopping: %s exited%s", ", ".join(f"{n} (code {c})" for n, c in dead.items()),
                          "" if ready else " before every stage served")
                for name in dead:
                    log.error("last lines of %s:\n%s", name, tails[name].text())
                if daemon is not None and not ready:
                    log.error("the stages on a shared GPU ran under CUDA MPS: --no-mps runs them without")
                return 1
            if not ready and _gateway_ready(health, plan):
                ready = True
                log.info("epdserve ready on http://%s:%d (model=%s) in %.1f s", cfg.host, cfg.port,
                         cfg.served_model_name or model_path, time.monotonic() - started)
                log.info("metrics: %s", " ".join(f"{n}={u}" for n, u in plan.metrics.items()))
            if not ready and time.monotonic() > deadline:
                log.error("servers not ready after %.0f s", ready_timeout_s)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop(procs, plan)
        if daemon is not None:
            daemon.stop()


def _stop(procs: dict[str, subprocess.Popen], plan: LaunchPlan, grace_s: float = 10.0) -> None:
    """SIGTERM every server, the gateway first and alone (up to 5 s of ``grace_s``): once it has stopped, no new work
    reaches the stages and it does not log their going away as failures; then the others, in start order. Whatever
    is still running after ``grace_s`` is killed."""
    deadline = time.monotonic() + grace_s
    gateway = procs.get("gateway")
    if gateway is not None and gateway.poll() is None:
        gateway.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            gateway.wait(timeout=min(5.0, grace_s))
    for name in [*plan.names("encoder"), *plan.names("prefill"), *plan.names("decode")]:
        if name in procs and procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
