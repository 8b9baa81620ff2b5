"""Start epdserve encoders, prefill and decode servers with SGLang gRPC workers (``--grpc-port``, beside their HTTP
fronts, which the tests read ``/loads`` from) and smg in PD mode over ``grpc://`` workers, on free ports.

Used by tests/test_smg_grpc.py and runnable by hand for the full-size runs::

    python tests/smg_grpc_cluster.py --encoders 2 --prefills 2 --decodes 2
    # the issue's acceptance run: 200 shared-prefix requests (half with an image) through smg, then exit
    python tests/smg_grpc_cluster.py --arch qwen3-vl --encoders 2 --prefills 2 --decodes 2 --bench 200
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from smg_cluster import Cluster, start_cluster


def start_grpc_cluster(model_path: str, log_dir: Path, *, encoders: int = 1, prefills: int = 1, decodes: int = 1,
                       timeout_s: float = 240.0, request_timeout_s: float = 60.0, num_pages: int = 1024,
                       smg_args: tuple[str, ...] = ()) -> Cluster:
    """:func:`smg_cluster.start_cluster` with ``grpc://`` prefill and decode workers and smg's default policy.

    Raises:
        RuntimeError: a server exited or did not get ready within ``timeout_s``; smg is not installed.
    """
    return start_cluster(model_path, log_dir, encoders=encoders, prefills=prefills, decodes=decodes, policy=None,
                         timeout_s=timeout_s, request_timeout_s=request_timeout_s, num_pages=num_pages,
                         smg_args=smg_args, grpc_workers=True)


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
