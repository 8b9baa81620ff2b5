"""The decode server's loop alone, constrained against unconstrained: ``python -m epdserve.bench.decode_loop
--model-path DIR --batch-sizes 1 32 128 [--context 512] [--steps 128] [--output-json F]``.

Why (issue 46): through ``epdserve launch`` a JSON schema's cost at 32 or 128 concurrent requests is hidden under
the noise of encode and prefill sharing the GPU and of constrained answers ending sooner (docs/performance.md,
"Constrained decoding: interleaved A/B"). Here a real :class:`~epdserve.decode.scheduler.DecodeScheduler` (CUDA
graphs, overlap scheduling, its ``GrammarMasker``) decodes B requests whose prompt KV is random and already
handed off, with nothing else on the device: the time per loop turn at a steady batch is the TPOT of that batch,
and the two modes differ only by the grammar. Modes are interleaved (none, schema, none, schema); each run admits
B requests, waits ``--warmup`` turns, then times ``--steps`` turns.

The schema is the issue's (an object with a string, an array of ``{name, count}`` objects and a boolean); each
constrained request starts from the token ``{`` as if prefill had sampled it, and decodes greedily with
``ignore_eos``: a request whose JSON closes ends early, and ``rows_mean`` says how full the batch stayed.
Reported per run: ms per turn, rows per step, and the decode metrics' host times (launch, wait for the device,
grammar fill and accept). The script imports only the scheduler's public pieces, so it also runs against another
checkout's package (``PYTHONPATH``) for a before/after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "caption": {"type": "string"},
    "objects": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "count": {"type": "integer"}}, "required": ["name", "count"]}},
    "outdoor": {"type": "boolean"}}, "required": ["caption", "objects", "outdoor"]}


_HISTOGRAMS = ("batch_size", "step_launch_seconds", "step_wait_seconds", "grammar_fill_seconds",
               "grammar_accept_seconds")


def _snapshot(metrics) -> dict[str, tuple[float, float]]:
    """``{histogram: (sum, count)}`` of the decode histograms this bench reports."""
    return {h: (metrics.value(f"epdserve:{h}_sum"), metrics.value(f"epdserve:{h}_count")) for h in _HISTOGRAMS}


def _means(before: dict, after: dict) -> dict[str, float | None]:
    """Each histogram's mean over the observations between two snapshots (None: none)."""
    out = {}
    for h in _HISTOGRAMS:
        total, count = after[h][0] - before[h][0], after[h][1] - before[h][1]
        out[h] = total / count if count else None
    return out


def run(runner, grammars, first_token: int, batch: int, context: int, steps: int, warmup: int,
        constrained: bool, room0: int) -> dict:
    """One run: ``batch`` requests of ``context`` prompt tokens admitted at once, ``warmup`` loop turns, then
    ``steps`` timed turns. Returns ``{"batch", "mode", "ms_per_turn", "rows_mean", ...}``."""
    from epdserve.decode.scheduler import DecodeScheduler
    from epdserve.wire.messages import DecodeRequest, GrammarSpec, KVTransfer, SamplingParams

    sched = DecodeScheduler(runner, context_length=context + warmup + steps + 8, max_running_requests=batch,
                            timeout_s=600, kv_endpoint="tcp://127.0.0.1:1", grammars=grammars)
    cfg = runner.config
    kv = torch.randn(cfg.num_kv_layers, 2, context, cfg.num_kv_heads, cfg.head_dim, device=runner.device,
                     generator=torch.Generator(device=runner.device).manual_seed(0)).to(runner.dtype) * 0.5
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    sp = SamplingParams(temperature=0, max_new_tokens=warmup + steps + 4, ignore_eos=True, grammar=grammar)
    for i in range(batch):
        room = room0 + i
        sched.add_request(DecodeRequest(rid=f"r{room}", prompt_len=context, sampling=sp, bootstrap_host="127.0.0.1",
                                        bootstrap_port=1, bootstrap_room=room), peer=b"bench")
        sched.add_transfer(KVTransfer(rid=f"r{room}", bootstrap_room=room, first_token_id=first_token, kv=kv))
    deadline = time.monotonic() + 120
    while len(sched.running) < batch:  # grammars compile on a worker thread
        sched.step()
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(sched.running)} of {batch} requests admitted (grammar errors?)")
        time.sleep(0.001)
    for _ in range(warmup):
        sched.step()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    before = _snapshot(sched.metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    seconds = time.perf_counter() - t0
    means = _means(before, _snapshot(sched.metrics))
    sched.fail_all("benchmark over")
    if sched.inflight is not None or getattr(sched, "ahead", None) is not None:
        raise RuntimeError("the scheduler still holds a step after fail_all")
    ms = {k.removesuffix("_seconds") + "_ms": None if v is None else round(v * 1e3, 4) for k, v in means.items()
          if k != "batch_size"}
    return {"batch": batch, "mode": "schema" if constrained else "none",
            "ms_per_turn": round(seconds / steps * 1e3, 4), "rows_mean": round(means["batch_size"] or 0.0, 2), **ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epdserve.bench.decode_loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each request (random KV)")
    p.add_argument("--steps", type=int, default=128, help="timed loop turns per run")
    p.add_argument("--warmup", type=int, default=8, help="untimed turns after admission")
    p.add_argument("--repeats", type=int, default=2, help="none/schema pairs per batch size")
    p.add_argument("--device", default="auto")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from epdserve.device import resolve_device
    from epdserve.engine.grammar import GrammarCompiler
    from epdserve.engine.model_runner import ModelRunner

    dev = resolve_device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pages = max(args.batch_sizes) * -(-(args.context + args.warmup + args.steps + 16) // 16) + 8
    runner = ModelRunner(args.model_path, device=dev, dtype=dtype, num_pages=pages, page_size=16,
                         cuda_graph_max_bs=max(args.batch_sizes) if dev.type == "cuda" else 0)
    first = AutoTokenizer.from_pretrained(args.model_path).encode("{", add_special_tokens=False)
    if len(first) != 1:
        raise SystemExit(f"the tokenizer writes '{{' as {len(first)} tokens; the schema runs need one")
    grammars = GrammarCompiler(args.model_path, runner.config.vocab_size, list(runner.config.eos_token_ids))
    rows, room = [], 0
    try:
        for batch in args.batch_sizes:
            for _ in range(args.repeats):
                for constrained in (False, True):
                    r = run(runner, grammars, first[0], batch, args.context, args.steps, args.warmup, constrained,
                            room)
                    room += batch
                    rows.append(r)
                    print("  ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    finally:
        grammars.close()
    for batch in args.batch_sizes:
        none = [r["ms_per_turn"] for r in rows if r["batch"] == batch and r["mode"] == "none"]
        schema = [r["ms_per_turn"] for r in rows if r["batch"] == batch and r["mode"] == "schema"]
        print(f"batch {batch}: ms per turn none {statistics.median(none):.3f}, schema {statistics.median(schema):.3f}"
              f" ({statistics.median(schema) / statistics.median(none):.3f}x)")
    if args.output_json:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        with open(args.output_json, "w") as f:
            json.dump({"device": name, "model_path": args.model_path, "context": args.context, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
