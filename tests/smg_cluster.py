"""Start epdserve encoders, prefill and decode servers (with HTTP fronts, and SGLang gRPC workers on request) and
smg in PD mode, or (``epd``) smg's own EPD mode in front of TokenSpeed-protocol workers, on free ports.

Used by tests/test_smg.py, test_smg_grpc.py and test_smg_epd.py, and runnable by hand for the full-size runs::

    python tests/smg_cluster.py --encoders 2 --prefills 2 --decodes 2 --policy cache_aware
    # issue 29's acceptance run: 200 shared-prefix requests (half with an image) through smg's gRPC mode, then exit
    python tests/smg_cluster.py --grpc-workers --arch qwen3-vl --encoders 2 --prefills 2 --decodes 2 --bench 200
    # smg --epd-disaggregation: smg sends images to the encoders itself (TokenSpeed's protocol on every worker)
    python tests/smg_cluster.py --epd --arch qwen3-vl --encoders 2 --prefills 1 --decodes 1
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from epdserve.wire.ports import free_port


def smg_executable() -> str | None:
    """The ``smg`` console script next to this Python, or on PATH; None when smg is not installed."""
    try:
        import smg  # noqa: F401
    except ImportError:
        return None
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    http: str = ""  # base URL of the HTTP front (prefill/decode) or of smg
    grpc: str = ""  # host:port (encoder)
    bootstrap_port: int = 0  # prefill: its KV bootstrap port; encoder (epd): its embedding bootstrap port


@dataclass
class Cluster:
    """The running processes; ``url`` is smg's base URL. :meth:`stop` ends them all."""

    log_dir: Path
    servers: dict[str, Server] = field(default_factory=dict)
    url: str = ""
    smg_cmd: list[str] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], **kw) -> Server:
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.servers[name] = Server(name, proc, **kw)
        return self.servers[name]

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL one server's process (its HTTP front dies with it)."""
        self.servers[name].proc.kill()
        self.servers[name].proc.wait()

    def stop(self) -> None:
        for s in self.servers.values():
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for s in self.servers.values():
            try:
                s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait()


def _wait_http(cluster: Cluster, name: str, url: str, deadline: float) -> None:
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if cluster.servers[name].proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not get ready:\n{cluster.log(name)[-3000:]}")
        time.sleep(0.3)


def stage_loads(url: str) -> dict:
    """The ``/loads`` entry of the prefill or decode HTTP front at ``url``."""
    r = httpx.get(f"{url}/loads", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["loads"][0]


def load_at_rest(load: dict) -> bool:
    """Nothing in flight: no request, no room, no embedding, no KV page but evictable radix-cache pages."""
    return (load["num_running_reqs"] == load["num_waiting_reqs"] == load["rooms"] == load["embeddings"] == 0
            and load["kv_pages_used"] == load["kv_pages_cached"])


def wait_at_rest(cluster: "Cluster", names: list[str], within_s: float) -> dict[str, dict]:
    """Wait until the fronts of servers ``names`` are at rest; returns their loads. Fails the test after
    ``within_s`` seconds, with the loads."""
    import pytest

    deadline = time.monotonic() + within_s
    while True:
        loads = {n: stage_loads(cluster.servers[n].http) for n in names}
        if all(map(load_at_rest, loads.values())):
            return loads
        if time.monotonic() > deadline:
            pytest.fail(f"not back at baseline after {within_s} s: {loads}")
        time.sleep(0.3)


def bench_killing(cluster: "Cluster", name: str, bench: Callable[[], dict]) -> tuple[list[dict], list[dict]]:
    """Run ``bench`` (an ``epdserve bench`` run returning its JSON record) on a thread, kill server ``name`` as soon
    as its front reports a running request, and return the run's ``(requests, failed requests)``."""
    import threading

    result = {}
    runner = threading.Thread(target=lambda: result.update(doc=bench()))
    runner.start()
    deadline = time.monotonic() + 60
    while stage_loads(cluster.servers[name].http)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, f"{name} got no request"
        time.sleep(0.05)
    cluster.kill(name)
    runner.join(timeout=180)
    requests = result["doc"]["requests"]
    return requests, [r for r in requests if not r["success"]]


def start_cluster(model_path: str, log_dir: Path, *, encoders: int = 1, prefills: int = 1, decodes: int = 1,
                  policy: str | None = "cache_aware", timeout_s: float = 240.0, request_timeout_s: float = 60.0,
                  num_pages: int = 1024, smg_args: tuple[str, ...] = (), grpc_workers: bool = False,
                  epd: bool = False, encoder_args: tuple[str, ...] = ()) -> Cluster:
    """Start everything and wait until smg answers ``/health`` and every stage's ``/health`` is 200.

    ``grpc_workers``: prefill and decode also serve SGLang's scheduler gRPC protocol (``--grpc-port``; each
    server's ``grpc`` is its ``host:port``) and smg reaches them as ``grpc://`` workers; their HTTP fronts stay,
    for the tests' ``/loads`` and ``/health``. ``policy`` None leaves smg's default.

    ``epd``: smg's ``--epd-disaggregation`` (``--encode-policy consistent_hashing``): the encoders serve smg's encode
    protocol with a ``--bootstrap-port`` each, prefill and decode TokenSpeed's scheduler protocol
    (``--grpc-protocol tokenspeed``); the prefill gets no ``--encoder-urls`` (smg picks the encoder). The exact smg
    command line is in ``cluster.smg_cmd``. ``encoder_args``: more flags for every encoder.

    Raises:
        RuntimeError: a server exited or did not get ready within ``timeout_s``; smg is not installed.
    """
    exe = smg_executable()
    if exe is None:
        raise RuntimeError("smg is not installed")
    cluster = Cluster(Path(log_dir))
    py = [sys.executable, "-m", "epdserve", "--log-level", "INFO"]
    lm = ["--model-path", model_path, "--num-pages", str(num_pages), "--request-timeout-s", str(request_timeout_s)]
    grpc_workers = grpc_workers or epd
    try:
        enc = []
        for i in range(encoders):
            port, boot = free_port(), free_port() if epd else 0
            enc.append(f"127.0.0.1:{port}")
            extra = ["--bootstrap-port", str(boot), "--metrics-port", "0"] if epd else []
            cluster.start(f"encoder{i}", [*py, "encoder", "--model-path", model_path, "--port", str(port), *extra,
                                           *encoder_args],
                          grpc=enc[-1], bootstrap_port=boot)

        def worker_grpc() -> tuple[list[str], str]:
            port = free_port() if grpc_workers else 0
            protocol = ["--grpc-protocol", "tokenspeed"] if epd else []
            return (["--grpc-port", str(port), *protocol], f"127.0.0.1:{port}") if grpc_workers else ([], "")

        for i in range(prefills):
            port, boot = free_port(), free_port()
            flags, grpc_addr = worker_grpc()
            cluster.start(f"prefill{i}", [*py, "prefill", *lm, "--port", str(port), "--bootstrap-port", str(boot),
                                          "--zmq-port", str(free_port()), "--embed-port", str(free_port()),
                                          *([] if epd else ["--encoder-urls", ",".join(enc)]), *flags],
                          http=f"http://127.0.0.1:{port}", bootstrap_port=boot, grpc=grpc_addr)
        for i in range(decodes):
            port = free_port()
            flags, grpc_addr = worker_grpc()
            cluster.start(f"decode{i}", [*py, "decode", *lm, "--port", str(port), "--zmq-port", str(free_port()),
                                         "--kv-port", str(free_port()), *flags],
                          http=f"http://127.0.0.1:{port}", grpc=grpc_addr)
        deadline = time.monotonic() + timeout_s
        for name, s in list(cluster.servers.items()):
            if s.http:
                _wait_http(cluster, name, f"{s.http}/health", deadline)
        gw = free_port()
        mode = ["--epd-disaggregation", "--encode-policy", "consistent_hashing"] if epd else ["--pd-disaggregation"]
        cmd = [exe, "launch", *mode, "--host", "127.0.0.1", "--port", str(gw),
               "--prometheus-port", str(free_port()), "--log-level", "warn"]
        cmd += ["--policy", policy] if policy else []
        cmd += ["--model-path", model_path] if grpc_workers else []
        for s in list(cluster.servers.values()):
            url = f"grpc://{s.grpc}" if grpc_workers else s.http
            if s.name.startswith("prefill"):
                cmd += ["--prefill", url, str(s.bootstrap_port)]
            elif s.name.startswith("decode"):
                cmd += ["--decode", url]
            elif s.name.startswith("encoder") and epd:
                cmd += ["--encode", url, str(s.bootstrap_port)]
        cluster.smg_cmd = [*cmd, *smg_args]
        cluster.start("smg", cluster.smg_cmd, http=f"http://127.0.0.1:{gw}")
        cluster.url = f"http://127.0.0.1:{gw}"
        _wait_http(cluster, "smg", f"{cluster.url}/v1/models", deadline)
        while not httpx.get(f"{cluster.url}/v1/models", timeout=2).json().get("data"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg registered no model:\n{cluster.log('smg')[-3000:]}")
            time.sleep(0.3)
        return cluster
    except BaseException:
        cluster.stop()
        raise


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="")
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--prefills", type=int, default=1)
    ap.add_argument("--decodes", type=int, default=1)
    ap.add_argument("--policy", default=None, help="smg's --policy (default: cache_aware, or smg's own with gRPC)")
    ap.add_argument("--grpc-workers", action="store_true", help="smg reaches prefill and decode as grpc:// workers")
    ap.add_argument("--epd", action="store_true", help="smg --epd-disaggregation (TokenSpeed protocol workers)")
    ap.add_argument("--arch", default="", help="with no --model-path: the tiny model's architecture (e.g. qwen3-vl, "
                                               "whose images smg 1.13 can send to gRPC workers)")
    ap.add_argument("--bench", type=int, default=0, help="run this many shared-prefix requests, print, exit")
    args = ap.parse_args()
    from epdserve.models.paths import resolve_model_path

    logs = Path(tempfile.mkdtemp(prefix="smg-cluster-"))
    model = args.model_path
    if not model and args.arch:
        from epdserve.entry.cli import main as cli

        model = str(logs / f"tiny-{args.arch}")
        cli(["make-tiny-model", model, "--arch", args.arch])
    model = resolve_model_path(model)
    policy = args.policy or (None if args.grpc_workers or args.epd else "cache_aware")
    c = start_cluster(model, logs, encoders=args.encoders, prefills=args.prefills, decodes=args.decodes,
                      policy=policy, grpc_workers=args.grpc_workers, epd=args.epd)
    print(f"smg on {c.url}; logs in {logs}; Ctrl-C stops\n{' '.join(c.smg_cmd)}", flush=True)
    try:
        if args.bench:
            from epdserve.bench.cli import main as bench

            bench(["--base-url", c.url, "--model", model, "--dataset", "shared-prefix", "--num-prompts",
                   str(args.bench), "--output-len", "8", "--max-concurrency", "16", "--warmup", "0",
                   "--output-json", str(logs / "bench.json"), "--disable-tqdm"])
            for name, s in c.servers.items():
                if s.http and name != "smg":  # every stage back at baseline
                    print(name, stage_loads(s.http), flush=True)
        else:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
