"""Start epdserve encoders, prefill and decode servers with SGLang gRPC workers (``--grpc-port``, beside their HTTP
fronts, which the tests read ``/loads`` from) and smg in PD mode over ``grpc://`` workers, on free ports.

Used by tests/test_smg_grpc.py and runnable by hand for the full-size runs::

    python tests/smg_grpc_cluster.py --encoders 2 --prefills 2 --decodes 2
    # the issue's acceptance run: 200 shared-prefix requests (half with an image) through smg, then exit
    python tests/smg_grpc_cluster.py --arch qwen3-vl --encoders 2 --prefills 2 --decodes 2 --bench 200
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx

from smg_cluster import Cluster, _wait_http, smg_executable
from epdserve.wire.transport import free_port


def start_grpc_cluster(model_path: str, log_dir: Path, *, encoders: int = 1, prefills: int = 1, decodes: int = 1,
                       timeout_s: float = 240.0, request_timeout_s: float = 60.0, num_pages: int = 1024,
                       smg_args: tuple[str, ...] = ()) -> Cluster:
    """Start everything and wait until every stage's ``/health`` is 200 and smg lists the model. Each server's
    ``grpc`` is its ``host:port`` of the gRPC worker; ``http`` its HTTP front.

    Raises:
        RuntimeError: a server exited or did not get ready within ``timeout_s``; smg is not installed.
    """
    exe = smg_executable()
    if exe is None:
        raise RuntimeError("smg is not installed")
    cluster = Cluster(Path(log_dir))
    py = [sys.executable, "-m", "epdserve", "--log-level", "INFO"]
    lm = ["--model-path", model_path, "--num-pages", str(num_pages), "--request-timeout-s", str(request_timeout_s)]
    try:
        enc = []
        for i in range(encoders):
            port = free_port()
            enc.append(f"127.0.0.1:{port}")
            cluster.start(f"encoder{i}", [*py, "encoder", "--model-path", model_path, "--port", str(port)])
        for i in range(prefills):
            port, boot, grpc_port = free_port(), free_port(), free_port()
            cluster.start(f"prefill{i}", [*py, "prefill", *lm, "--port", str(port), "--grpc-port", str(grpc_port),
                                          "--bootstrap-port", str(boot), "--zmq-port", str(free_port()),
                                          "--embed-port", str(free_port()), "--encoder-urls", ",".join(enc)],
                          http=f"http://127.0.0.1:{port}", grpc=f"127.0.0.1:{grpc_port}", bootstrap_port=boot)
        for i in range(decodes):
            port, grpc_port = free_port(), free_port()
            cluster.start(f"decode{i}", [*py, "decode", *lm, "--port", str(port), "--grpc-port", str(grpc_port),
                                         "--zmq-port", str(free_port()), "--kv-port", str(free_port())],
                          http=f"http://127.0.0.1:{port}", grpc=f"127.0.0.1:{grpc_port}")
        deadline = time.monotonic() + timeout_s
        for name, s in list(cluster.servers.items()):
            if s.http:
                _wait_http(cluster, name, f"{s.http}/health", deadline)
        gw = free_port()
        cmd = [exe, "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(gw),
               "--prometheus-port", str(free_port()), "--log-level", "warn", "--model-path", model_path]
        for s in list(cluster.servers.values()):
            if s.name.startswith("prefill"):
                cmd += ["--prefill", f"grpc://{s.grpc}", str(s.bootstrap_port)]
            elif s.name.startswith("decode"):
                cmd += ["--decode", f"grpc://{s.grpc}"]
        cluster.start("smg", [*cmd, *smg_args], http=f"http://127.0.0.1:{gw}")
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
    ap.add_argument("--arch", default="", help="with no --model-path: the tiny model's architecture (e.g. qwen3-vl, "
                                               "whose images smg 1.13 can send to gRPC workers)")
    ap.add_argument("--bench", type=int, default=0, help="run this many shared-prefix requests, print, exit")
    args = ap.parse_args()
    from epdserve.models.paths import resolve_model_path

    logs = Path(tempfile.mkdtemp(prefix="smg-grpc-cluster-"))
    model = args.model_path
    if not model and args.arch:
        from epdserve.entry.cli import main as cli

        model = str(logs / f"tiny-{args.arch}")
        cli(["make-tiny-model", model, "--arch", args.arch])
    model = resolve_model_path(model)
    c = start_grpc_cluster(model, logs, encoders=args.encoders, prefills=args.prefills, decodes=args.decodes)
    print(f"smg on {c.url}; logs in {logs}; Ctrl-C stops", flush=True)
    try:
        if args.bench:
            from epdserve.bench.cli import main as bench

            bench(["--base-url", c.url, "--model", model, "--dataset", "shared-prefix", "--num-prompts",
                   str(args.bench), "--output-len", "8", "--max-concurrency", "16", "--warmup", "0",
                   "--output-json", str(logs / "bench.json"), "--disable-tqdm"])
            for name, s in c.servers.items():
                if s.http and name != "smg":  # every stage back at baseline
                    print(name, httpx.get(f"{s.http}/loads", timeout=10).json()["loads"][0], flush=True)
        else:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
