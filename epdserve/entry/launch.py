"""``epdserve launch``: ``--num-encoders`` encoders, prefill, decode and gateway as processes on one machine.

Internal servers bind 127.0.0.1 on free ports (their ``/metrics`` ports too); only the gateway takes
``--host``/``--port`` (it gets every encoder's address) and serves its ``/metrics`` there. Children log in the
launcher's ``--log-level`` and ``--log-format``, through the launcher's stderr. The launcher waits until the
gateway's ``/health`` answers 200 and lists every encoder up (the gateway has then seen prefill and decode, with
all their TP ranks, answer, and every encoder's gRPC health say SERVING), logs one ready line and one line of
every process's ``/metrics`` URL, and on SIGINT/SIGTERM (or any child dying) stops all; a child that dies before
the ready line is named with its last log lines. Stages that share a GPU run under a CUDA MPS daemon of the
launcher's own (:mod:`epdserve.entry.mps`; ``--no-mps``: time-slicing).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from epdserve.config import LaunchConfig
from epdserve.entry import mps
from epdserve.logging_setup import active_format
from epdserve.models.paths import resolve_model_path
from epdserve.wire.transport import LOCAL as _LOCAL
from epdserve.wire.transport import free_ports

log = logging.getLogger("epdserve.entry.launch")


def _commands(cfg: LaunchConfig, model_path: str) -> tuple[dict[str, list[str]], list[str], dict[str, str]]:
    """The command line of every process by name (``encoder0``.., ``prefill``, ``decode``, ``gateway``), the
    encoders' addresses, and every process's ``/metrics`` URL by name."""
    metrics_names = [f"encoder{i}" for i in range(cfg.num_encoders)] + ["prefill", "decode"]
    pre, emb, boot, dec, kv, *rest = free_ports(5 + cfg.num_encoders + len(metrics_names))
    encoders = [f"{_LOCAL}:{port}" for port in rest[:cfg.num_encoders]]
    metrics_ports = dict(zip(metrics_names, rest[cfg.num_encoders:]))
    common = ["--model-path", model_path, "--device", cfg.device, "--dtype", cfg.dtype]
    kv_pool = ["--page-size", str(cfg.page_size), "--num-pages", str(cfg.num_pages), "--kv-transfer", cfg.kv_transfer]
    level = logging.getLevelName(logging.getLogger("epdserve").getEffectiveLevel())
    exe = [sys.executable, "-m", "epdserve", "--log-level", level, "--log-format", active_format()]
    # GPU placement: the encoders on one GPU, each LM server's TP ranks on consecutive GPUs from its base.
    encoder_device = f"cuda:{cfg.encoder_gpu}" if _on_gpus(cfg) else cfg.device
    commands = {f"encoder{i}": [*exe, "encoder", *common[:2], "--device", encoder_device, "--dtype", cfg.dtype,
                                "--port", addr.rsplit(":", 1)[1], "--metrics-port", str(metrics_ports[f"encoder{i}"]),
                                "--cuda-graphs", str(cfg.encoder_cuda_graphs),
                                "--compile" if cfg.encoder_compile else "--no-compile",
                                "--gpu-jpeg-decode" if cfg.encoder_gpu_jpeg_decode else "--no-gpu-jpeg-decode",
                                "--max-video-frames", str(cfg.max_video_frames),
                                "--max-video-duration-s", repr(cfg.max_video_duration_s)]
                for i, addr in enumerate(encoders)}
    commands |= {
        # --port 0: no HTTP front (that is for a PD router such as smg); the gateway speaks ZMQ to the stages.
        "prefill": [*exe, "prefill", *common, *kv_pool, "--port", "0", "--zmq-port", str(pre), "--embed-port",
                    str(emb), "--bootstrap-port", str(boot), "--metrics-port", str(metrics_ports["prefill"]),
                    "--tp", str(cfg.prefill_tp), "--base-gpu-id", str(cfg.prefill_base_gpu),
                    "--cuda-graph-max-tokens", str(cfg.prefill_cuda_graph_max_tokens),
                    "--chunked-prefill-size", str(cfg.prefill_chunked_prefill_size),
                    "--max-prefill-tokens", str(cfg.prefill_max_prefill_tokens)],
        "decode": [*exe, "decode", *common, *kv_pool, "--port", "0", "--zmq-port", str(dec), "--kv-port", str(kv),
                   "--metrics-port", str(metrics_ports["decode"]), "--tp", str(cfg.decode_tp),
                   "--base-gpu-id", str(cfg.decode_base_gpu)],
        "gateway": [*exe, "gateway", "--model-path", model_path, "--served-model-name", cfg.served_model_name,
                    "--host", cfg.host, "--port", str(cfg.port), "--encoder-addr", ",".join(encoders),
                    "--prefill-addr", f"tcp://{_LOCAL}:{pre}", "--decode-addr", f"tcp://{_LOCAL}:{dec}",
                    "--api-key", cfg.api_key, "--kserve-grpc-port", str(cfg.kserve_grpc_port),
                    "--max-video-bytes", str(cfg.max_video_bytes), "--max-n", str(cfg.max_n),
                    "--stage-timeout-s", repr(cfg.stage_timeout_s), "--max-video-frames", str(cfg.max_video_frames),
                    "--max-video-duration-s", str(cfg.max_video_duration_s)],
    }
    gateway_host = _LOCAL if cfg.host in ("0.0.0.0", "::") else cfg.host
    metrics = {"gateway": f"http://{gateway_host}:{cfg.port}/metrics"}
    metrics |= {name: f"http://{_LOCAL}:{port}/metrics" for name, port in metrics_ports.items()}
    return commands, encoders, metrics


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _on_gpus(cfg: LaunchConfig) -> bool:
    """Whether the stages go on GPUs by the placement flags (``--encoder-gpu``, the TP bases): a ``cuda`` or
    ``auto`` device on a machine with CUDA."""
    return cfg.device in ("cuda", "auto") and _has_cuda()


def _gateway_ready(url: str, num_encoders: int) -> bool:
    """True when the gateway's ``/health?details=1`` answers 200 (prefill, decode and an encoder serve, as the
    gateway sees them) and lists ``num_encoders`` encoders, every one up."""
    try:
        with urllib.request.urlopen(f"{url}?details=1", timeout=1) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):  # 503 (HTTPError is an OSError), refused, or a body that is not JSON
        return False
    encoders = body.get("stages", {}).get("encoders", [])
    return len(encoders) == num_encoders and all(e.get("up") for e in encoders)


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


def launch(cfg: LaunchConfig, ready_timeout_s: float = 600.0) -> int:
    """Run the four servers until a signal or a child exits. Returns the exit code (0 after Ctrl-C).

    A hub id ``--model-path`` is downloaded here, once (``epdserve launch`` has already done it: see
    :func:`epdserve.entry.cli._local_model`), and the stages get the local directory.

    Raises:
        ModelSourceError (a FileNotFoundError): ``cfg.model_path`` names no usable checkpoint.
        ValueError: ``cfg.num_encoders`` < 1.
    """
    if cfg.num_encoders < 1:
        raise ValueError(f"--num-encoders must be at least 1, got {cfg.num_encoders}")
    started = time.monotonic()
    # The default model built, a hub id downloaded, once, before the children race for it.
    model_path = resolve_model_path(cfg.model_path, cfg.revision)
    commands, encoder_addrs, metrics_urls = _commands(cfg, model_path)
    procs: dict[str, subprocess.Popen] = {}
    tails: dict[str, _LogTail] = {}
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    daemon, mps_env = None, {}
    try:
        if _on_gpus(cfg):
            gpus = mps.stage_gpus(cfg.num_encoders, cfg.encoder_gpu, (cfg.prefill_base_gpu, cfg.prefill_tp),
                                  (cfg.decode_base_gpu, cfg.decode_tp))
            daemon, mps_env = mps.start_for(gpus, cfg.mps)
        for name, cmd in commands.items():
            # A new session keeps the terminal's Ctrl-C away from the children: the launcher stops them in order.
            env = os.environ | mps_env[name] if name in mps_env else None
            procs[name] = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, env=env)
            tails[name] = _LogTail(procs[name].stderr)
        health = f"http://{_LOCAL if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}/health"
        deadline, ready = time.monotonic() + ready_timeout_s, False
        while not stopping:
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead:
                log.error("stopping: %s exited%s", ", ".join(f"{n} (code {c})" for n, c in dead.items()),
                          "" if ready else " before every stage served")
                for name in dead:
                    log.error("last lines of %s:\n%s", name, tails[name].text())
                if daemon is not None and not ready:
                    log.error("the stages on a shared GPU ran under CUDA MPS: --no-mps runs them without")
                return 1
            if not ready and _gateway_ready(health, len(encoder_addrs)):
                ready = True
                log.info("epdserve ready on http://%s:%d (model=%s) in %.1f s", cfg.host, cfg.port,
                         cfg.served_model_name or model_path, time.monotonic() - started)
                log.info("metrics: %s", " ".join(f"{n}={u}" for n, u in metrics_urls.items()))
            if not ready and time.monotonic() > deadline:
                log.error("servers not ready after %.0f s", ready_timeout_s)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop(procs)
        if daemon is not None:
            daemon.stop()


def _stop(procs: dict[str, subprocess.Popen], grace_s: float = 10.0) -> None:
    # Gateway first, so no new work reaches the stages while they stop.
    order = ["gateway", *(n for n in procs if n.startswith("encoder")), "prefill", "decode"]
    for name in order:
        if name in procs and procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
