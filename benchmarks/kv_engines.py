"""KV hand-off paths side by side: ``epdserve launch --kv-transfer <mode>`` for each mode, one after another in one
run, the same requests to each (a ~4k-token prompt with an image, 2 output tokens), and per mode:

- TTFT as the client sees it (streamed, the first chunk carrying a token), median over the requests;
- the hand-off time: from prefill's "prefilled" log line (after the forward, before any gather) to decode's "KV
  received" line (JSON log timestamps, milliseconds, one clock: one machine); it covers the gather into host
  memory, serialisation and ZeroMQ for ``zmq``, and the engine's write into decode's pages plus the tensor-less
  ``KVTransfer`` for the engines (decode's scatter of zmq's KV into its pages, at admission, is not in it);
- the KV bytes of the prompt and MB/s = bytes / hand-off time; for the engines also the write alone (the
  engine's own submit-to-completion time, ``engine_seconds``);
- the hand-off's share of TTFT.

Usage (docs/performance.md has the table)::

    python benchmarks/kv_engines.py --modes zmq,nixl,mooncake --requests 5
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx


def _image(seed: int, size: int = 224) -> str:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ttft(url: str, model: str, seed: int, words: int) -> tuple[float, str]:
    """One streamed request (distinct text and image: no radix or encoder cache hit); (TTFT s, request id)."""
    text = f"{seed} " + " ".join(f"w{(seed * 7919 + i) % 997}" for i in range(words)) + " Describe the picture."
    req = {"model": model, "stream": True, "max_completion_tokens": 2, "temperature": 0, "ignore_eos": True,
           "return_token_ids": True,
           "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image(seed)}},
                                                     {"type": "text", "text": text}]}]}
    t0, first, rid = time.perf_counter(), None, ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=req, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            if first is None and chunk.get("choices") and chunk["choices"][0].get("token_ids"):  # not the role
                first = time.perf_counter() - t0
    return first, rid


def _times(log: str, rid: str) -> tuple[float, float, int, float, int]:
    """(prefilled at, KV received at, prompt tokens, engine write s or -1, engine bytes) from the JSON log."""
    at = {}
    for line in log.splitlines():
        if rid not in line or not line.startswith("{"):
            continue
        rec = json.loads(line)
        msg = rec.get("message", "")
        ts = datetime.fromisoformat(rec["time"]).timestamp()
        if m := re.search(r"prefilled (\d+) tokens", msg):
            at["prefilled"], at["n"] = ts, int(m.group(1))
        elif "KV received" in msg:
            at["received"] = ts
            m = re.search(r"engine: (\d+) bytes in ([\d.]+) ms", msg)
            at["bytes"], at["write"] = (int(m.group(1)), float(m.group(2)) / 1e3) if m else (0, -1.0)
    return at["prefilled"], at["received"], at["n"], at["write"], at["bytes"]


def run_mode(mode: str, model: str, requests: int, words: int, log_dir: Path, device: str = "cpu",
             launch_args: tuple[str, ...] = (), ready_s: float = 300) -> dict:
    """Launch with ``--kv-transfer mode`` (plus ``launch_args``), send one warm-up and ``requests`` measured
    requests, stop.

    Raises:
        RuntimeError: the launch exited or was not ready within ``ready_s`` seconds.
    """
    from epdserve.wire.ports import free_port

    port, log_path = free_port(), log_dir / f"{mode}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "epdserve", "--log-level", "DEBUG", "--log-format", "json",
                                 "launch", "--model-path", model, "--port", str(port), "--device", device,
                                 "--kv-transfer", mode, *launch_args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + ready_s
            while "metrics: gateway=" not in log_path.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: launch failed:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.3)
            url = f"http://127.0.0.1:{port}"
            _ttft(url, model, 10_000, words)  # warm-up
            runs = [_ttft(url, model, i, words) for i in range(requests)]
            time.sleep(1.0)  # the DEBUG lines of the last request are flushed by now
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    text = log_path.read_text()
    rows = [(ttft, *_times(text, rid)) for ttft, rid in runs]
    hand = [r[2] - r[1] for r in rows]
    return {"mode": mode, "tokens": rows[0][3], "ttft": statistics.median(r[0] for r in rows),
            "hand_off": statistics.median(hand), "share": statistics.median(h / r[0] for h, r in zip(hand, rows)),
            "write": statistics.median(r[4] for r in rows), "bytes": rows[0][5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="zmq,nixl,mooncake")
    p.add_argument("--model-path", default="", help="default: the tiny test checkpoint, made in a temp dir")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--words", type=int, default=950, help="prompt words (the tiny tokenizer: ~4 tokens each)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--ready-s", type=float, default=300, help="longest wait for each launch's ready line")
    p.add_argument("--output-json", default="", help="write the table's rows (and any mode's failure) here")
    p.add_argument("launch_args", nargs="*", help="more `epdserve launch` flags, after `--`")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kv-engines-"))
    model = a.model_path
    if not model:
        from epdserve.models.tiny import make_tiny_model

        model = str(make_tiny_model(tmp / "tiny"))
    results, failed = [], {}
    for m in a.modes.split(","):
        try:  # one mode failing (an engine that cannot start here) still leaves the others' figures
            results.append(run_mode(m, model, a.requests, a.words, tmp, a.device, tuple(a.launch_args), a.ready_s))
        except Exception as e:
            failed[m] = str(e)[-2000:]
            print(f"{m} failed: {failed[m]}", file=sys.stderr)
    kv_bytes = next((r["bytes"] for r in results if r["bytes"]), 0)
    if a.output_json:
        Path(a.output_json).write_text(json.dumps({"device": a.device, "model": model, "launch_args": a.launch_args,
                                                   "kv_bytes": kv_bytes, "results": results, "failed": failed},
                                                  indent=1))
    print("| path | prompt tokens | KV MB | TTFT ms | hand-off ms | MB/s | engine write ms | hand-off / TTFT |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        mb = kv_bytes / 1e6
        write = f"{r['write'] * 1e3:.1f}" if r["write"] >= 0 else "-"
        print(f"| {r['mode']} | {r['tokens']} | {mb:.1f} | {r['ttft'] * 1e3:.0f} | {r['hand_off'] * 1e3:.1f} | "
              f"{mb / r['hand_off']:.0f} | {write} | {r['share'] * 100:.1f} % |")
    print(f"(logs in {tmp})", file=sys.stderr)


if __name__ == "__main__":
    main()
