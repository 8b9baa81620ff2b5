"""``python -m epdserve.bench.gateway``: how many streamed tokens per second the gateway alone can deliver.

    python -m epdserve.bench.gateway --concurrency 32 128 --step-ms 8 --output-len 256 [--output-json out.json]

Synthetic prefill and decode servers (a separate process, no model) stand in for the stages. The decode one
acts like the real one: every ``--step-ms`` it sends one ``TokenOutputBatch`` with one new token for each running
request, and it ends each request at its ``max_new_tokens``. The gateway runs as its own process (``epdserve
gateway``, the tiny model's tokenizer). ``epdserve bench`` streams text-only chats at each ``--concurrency`` level.

Offered load is ``concurrency * 1000 / step_ms`` tokens per second. A gateway that keeps up delivers about that,
with an ITL median near ``--step-ms``. A gateway that falls behind delivers less, and its tokens reach the client
in bursts (an ITL median far below the step). Each row also gives the gateway process's CPU time per 1,000
delivered tokens (from /proc), which does not depend on whether the client keeps up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import httpx
import zmq

from epdserve.wire.messages import (
    AbortRequest, DecodeRequest, Load, LoadRequest, ServerInfo, ServerInfoRequest, TokenOutput, TokenOutputBatch,
    decode, encode,
)
from epdserve.wire.ports import free_port

from .report import print_rows, text_table

_TEXT = ("The quick brown fox jumps over the lazy dog while a small bird sings in the old oak tree near the river, "
         "and the children laugh as they run across the green field under a bright summer sky. ")


def _stages(ports: tuple[int, int, int], step_s: float, token_ids: list[int], ready) -> None:
    """The synthetic prefill and decode servers' loop, and an encoder that only answers gRPC health checks (the
    gateway waits for one); run in a child process until it is terminated."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    prefill_port, decode_port, encoder_port = ports
    encoder = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), encoder)  # "" is SERVING by default
    encoder.add_insecure_port(f"127.0.0.1:{encoder_port}")
    encoder.start()
    ctx = zmq.Context()
    socks = {}
    for role, port in (("prefill", prefill_port), ("decode", decode_port)):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{port}")
        socks[sock] = role
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    dec = next(s for s, r in socks.items() if r == "decode")
    running: dict[str, list] = {}  # rid -> [gateway peer, tokens sent, max_new_tokens, prompt_len]
    ready.set()
    next_step = time.monotonic() + step_s
    while True:
        for sock, _ in poller.poll(max(0.0, next_step - time.monotonic()) * 1000):
            peer, *frames = sock.recv_multipart()
            msg = decode(frames)
            role = socks[sock]
            if isinstance(msg, ServerInfoRequest):
                info = ServerInfo(role=role, model_path="synthetic", context_length=1 << 20, page_size=16,
                                  num_pages=1 << 16)
                if role == "prefill":
                    info.embed_endpoints, info.bootstrap_host, info.bootstrap_port = ["tcp://127.0.0.1:1"], "x", 1
                sock.send_multipart([peer, *encode(info)])
            elif isinstance(msg, LoadRequest):
                sock.send_multipart([peer, *encode(Load(role=role, num_running_reqs=len(running), num_waiting_reqs=0,
                                                        kv_pages_used=0, kv_pages_total=1 << 16))])
            elif isinstance(msg, DecodeRequest):
                running[msg.rid] = [peer, 0, msg.sampling.max_new_tokens, msg.prompt_len]
            elif isinstance(msg, AbortRequest):
                running.pop(msg.rid, None)
        if time.monotonic() < next_step:
            continue
        next_step += step_s
        by_peer: dict[bytes, list[TokenOutput]] = {}
        for rid, r in list(running.items()):
            r[1] += 1
            done = r[1] >= r[2]
            by_peer.setdefault(r[0], []).append(TokenOutput(
                rid, [token_ids[r[1] % len(token_ids)]], "length" if done else None, prompt_tokens=r[3],
                completion_tokens=r[1]))
            if done:
                del running[rid]
        for peer, outs in by_peer.items():
            dec.send_multipart([peer, *encode(TokenOutputBatch(outs))])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run(args: argparse.Namespace) -> list[dict]:
    """One row per ``--concurrency`` level (see the module docstring)."""
    from epdserve.bench.cli import main as bench_main
    from epdserve.models.paths import resolve_model_path

    model = resolve_model_path(args.model_path)
    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(model)(_TEXT, add_special_tokens=False)["input_ids"]
    prefill_port, decode_port, encoder_port, http_port = free_port(), free_port(), free_port(), free_port()
    ready = mp.get_context("spawn").Event()
    stages = mp.get_context("spawn").Process(target=_stages, daemon=True, args=(
        (prefill_port, decode_port, encoder_port), args.step_ms / 1000, token_ids, ready))
    stages.start()
    ready.wait(60)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "epdserve", "--log-level", "WARNING", "gateway", "--model-path", model,
         "--port", str(http_port), "--prefill-addr", f"tcp://127.0.0.1:{prefill_port}",
         "--decode-addr", f"tcp://127.0.0.1:{decode_port}", "--encoder-addr", f"127.0.0.1:{encoder_port}"])
    base = f"http://127.0.0.1:{http_port}"
    rows = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or gateway.poll() is not None:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.2)
        for c in args.concurrency:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cpu0, t0 = _cpu_seconds(gateway.pid), time.monotonic()
                with contextlib.redirect_stdout(io.StringIO()):  # its own report: the rows below summarize it
                    bench_main(["--base-url", base, "--dataset", "random-mm", "--images-per-request", "0",
                                "--input-len", "32", "--output-len", str(args.output_len), "--tokenizer", model,
                                "--num-prompts", str(c * args.rounds), "--max-concurrency", str(c),
                                "--warmup", "0", "--disable-tqdm", "--output-json", out.name])
                cpu, wall = _cpu_seconds(gateway.pid) - cpu0, time.monotonic() - t0
                summary = json.load(open(out.name))["summary"]
            tokens = summary["total_output_tokens"]
            rows.append({"concurrency": c, "step_ms": args.step_ms,
                         "offered_tok_s": c * 1000 / args.step_ms,
                         "delivered_tok_s": summary["output_token_throughput_tps"],
                         "itl_median_ms": summary["itl_ms"]["median"], "itl_p90_ms": summary["itl_ms"]["p90"],
                         "tpot_mean_ms": summary["tpot_ms"]["mean"],
                         "gateway_cpu_ms_per_1k_tokens": cpu / max(tokens, 1) * 1e6,
                         "gateway_cpu_share": cpu / wall, "failed": summary["failed_requests"]})
    finally:
        gateway.terminate()
        gateway.wait(30)
        stages.terminate()
    return rows


def _table(rows: list[dict]) -> str:
    return text_table([
        ("conc", 5, lambda r: str(r["concurrency"])),
        ("offered tok/s", 13, lambda r: f"{r['offered_tok_s']:.0f}"),
        ("delivered", 10, lambda r: f"{r['delivered_tok_s']:.0f}"),
        ("ITL med", 8, lambda r: f"{r['itl_median_ms']:.2f}"),
        ("ITL p90", 8, lambda r: f"{r['itl_p90_ms']:.2f}"),
        ("gw CPU ms/1k tok", 17, lambda r: f"{r['gateway_cpu_ms_per_1k_tokens']:.1f}"),
        ("gw CPU", 7, lambda r: f"{r['gateway_cpu_share']:.0%}"),
        ("failed", 6, lambda r: str(r["failed"])),
    ], rows)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run every concurrency level, print a table; exit status 0 (2 for bad flags)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default="", help="checkpoint whose tokenizer the gateway uses (default: tiny)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[32, 128], help="streaming clients per level")
    p.add_argument("--step-ms", type=float, default=8.0, help="synthetic decode step: one token per request per step")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--output-json", help="also write the config and the rows here")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.step_ms <= 0 or args.output_len < 2 or args.rounds < 1:
        p.error("--concurrency, --rounds >= 1, --step-ms > 0, --output-len >= 2")
    rows = run(args)
    print_rows(_table(rows), rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
