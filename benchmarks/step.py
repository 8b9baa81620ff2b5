"""The decode step alone: ``ModelRunner`` forwards + greedy sampling, no server, beside the memory roofline.

``python -m epdserve.bench.step --model-path DIR --batch-sizes 1 32 128 --context 512``

Per batch size it fills B requests' KV pages with random values at ``--context`` tokens each, then times
``--steps`` decode steps the way the decode server runs them (inputs built on the host from Python lists,
``runner.forward``, ``argmax``, one ``.tolist()``), wall clock per step. The roofline is the bytes one step must
read (every LM weight once, the embedding table aside, plus every request's KV; hybrid models' states read and
written) over the device-to-device copy
bandwidth measured in the same run (bytes read + written). "GPU ms" is the replayed graph alone (no host work):
the floor an overlapped server step can reach. The server's TPOT over these is the server's own overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.engine.model_runner import ModelRunner
from epdserve.models.mrope import decode_positions


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written (median of ``reps``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[3:])


def step_bytes(runner: ModelRunner, kv_tokens: int, batch_size: int = 0) -> int:
    """Bytes a decode step must move: LM weights (the input embedding table aside) + ``kv_tokens`` tokens of KV
    (the attention layers' only: ``config.num_kv_layers``) read, + for hybrid models each of the ``batch_size``
    requests' linear-attention state (conv and recurrent, every DeltaNet layer) read and written back."""
    model, cfg = runner.model, runner.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = kv_tokens * cfg.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * runner.kv_pool.buffer.element_size()
    state = 0 if runner.state_pool is None else 2 * batch_size * runner.state_pool.bytes_per_slot
    return weights + kv + state


def time_steps(runner: ModelRunner, batch_size: int, context: int, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` decode steps of ``batch_size`` requests starting at ``context`` tokens."""
    ps = runner.page_size
    per_req = -(-(context + steps + 1) // ps)
    if per_req * batch_size > runner.num_pages:
        raise ValueError(f"{batch_size} x {context + steps} tokens need {per_req * batch_size} pages, "
                         f"the pool has {runner.num_pages}")
    pages = [list(range(r * per_req, (r + 1) * per_req)) for r in range(batch_size)]
    runner.kv_pool.buffer[:, :, :per_req * batch_size].normal_()  # random KV: never time on zeros
    tokens = torch.randint(0, min(1000, runner.config.vocab_size), (batch_size,)).tolist()
    slots = None
    if runner.state_pool is not None:  # hybrid models: one state slot per request, random like the KV
        slots = [runner.state_pool.alloc() for _ in range(batch_size)]
        for buf in (runner.state_pool.conv_buffer, runner.state_pool.recurrent_buffer):
            buf.normal_()
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        idx = [context + step] * batch_size
        batch = ForwardBatch(
            True, torch.tensor(tokens, dtype=torch.int64),
            decode_positions(torch.tensor(idx), torch.zeros(batch_size, dtype=torch.int64)),
            torch.tensor([p[i // ps] * ps + i % ps for p, i in zip(pages, idx)], dtype=torch.int64),
            [1] * batch_size, [i + 1 for i in idx], pages, state_slots=slots)
        tokens = runner.forward(batch).argmax(-1).tolist()
        out.append(time.perf_counter() - t0)
    for slot in slots or ():
        runner.state_pool.free(slot)
    return out


def graph_gpu_time(runner: ModelRunner, batch_size: int, reps: int = 30) -> float | None:
    """Seconds of GPU time of one replay of the CUDA graph that serves ``batch_size`` (back-to-back replays timed
    with CUDA events, so no host work is counted); None without graphs. Call right after :func:`time_steps`: the
    replays reuse its last plan."""
    if runner.graphs is None or batch_size > runner.graphs.max_bs:
        return None
    graph = runner.graphs.graphs[next(s for s in runner.graphs.sizes if s >= batch_size)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def profile_replays(runner: ModelRunner, batch_size: int, reps: int = 10, top: int = 25) -> list[dict]:
    """The GPU kernels of ``reps`` replays of the graph serving ``batch_size`` (torch.profiler, CUDA activity),
    the ``top`` by total device time: ``[{name, calls_per_step, us_per_step}]``. Call right after
    :func:`time_steps`, as :func:`graph_gpu_time`. Empty without graphs."""
    if runner.graphs is None or batch_size > runner.graphs.max_bs:
        return []
    from torch.profiler import ProfilerActivity, profile

    graph = runner.graphs.graphs[next(s for s in runner.graphs.sizes if s >= batch_size)]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = [dict(name=e.key[:90], calls_per_step=e.count / reps, us_per_step=e.device_time_total / reps)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a table and optionally writes ``--output-json``. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m epdserve.bench.step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=512, help="KV tokens per request at the first step")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=0, help="0: sized from free memory")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also list each batch size's top GPU kernels over graph replays (torch.profiler)")
    ap.add_argument("--output-json", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    runner = ModelRunner(args.model_path, device=dev, dtype=torch.bfloat16, num_pages=args.num_pages, page_size=16,
                         cuda_graph_max_bs=0 if args.disable_cuda_graph else max(args.batch_sizes),
                         num_state_slots=max(args.batch_sizes))
    bw = copy_bandwidth(dev)
    rows = []
    for bs in args.batch_sizes:
        times = time_steps(runner, bs, args.context, args.steps)[4:]  # the first steps warm caches up
        median = statistics.median(times)
        gpu = graph_gpu_time(runner, bs)
        kv_tokens = bs * (args.context + args.steps // 2)
        roof = step_bytes(runner, kv_tokens, bs) / bw
        kernels = profile_replays(runner, bs) if args.profile else []
        rows.append(dict(batch_size=bs, context=args.context, step_ms=median * 1e3,
                         graph_gpu_ms=None if gpu is None else gpu * 1e3, roofline_ms=roof * 1e3,
                         roofline_fraction=roof / median, tokens_per_s=bs / median,
                         cuda_graph=runner.graphs is not None, kernels=kernels))
    print(f"device: {torch.cuda.get_device_name(dev)}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write); "
          f"CUDA graphs: {'on' if runner.graphs is not None else 'off'}")
    print(f"{'batch':>6} {'step ms':>9} {'GPU ms':>8} {'roofline ms':>12} {'of roofline':>12} {'tok/s':>10}")
    for r in rows:
        gpu = "-" if r["graph_gpu_ms"] is None else f"{r['graph_gpu_ms']:.3f}"
        print(f"{r['batch_size']:>6} {r['step_ms']:>9.3f} {gpu:>8} {r['roofline_ms']:>12.3f} "
              f"{100 * r['roofline_fraction']:>11.1f}% {r['tokens_per_s']:>10.0f}")
    for r in rows:
        if r["kernels"]:
            print(f"batch {r['batch_size']}: top GPU kernels per step (us, calls)")
            for k in r["kernels"]:
                print(f"  {k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  {k['name']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), copy_bandwidth=bw, model_path=args.model_path,
                           rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
