"""The decode step alone: ``ModelRunner`` forwards + greedy sampling, no server, beside the memory roofline.

``python -m epdserve.bench.step --model-path DIR --batch-sizes 1 32 128 --context 512``

Per batch size it fills B requests' KV pages with random values at ``--context`` tokens each, then times
``--steps`` greedy decode steps, wall clock per step, twice: one after the other ("step ms": inputs built on the
host from Python lists, ``runner.forward``, ``argmax``, one ``.tolist()``, so host work and GPU time add up), and
overlapped as the decode server runs them ("overlapped": the next step's host work while the previous one is on
the GPU, its input ids taken on the device; see :func:`time_steps`). The roofline is the bytes one step must
read (every LM weight once, the embedding table aside, plus every request's KV; hybrid models' states read and
written) over the device-to-device copy
bandwidth measured in the same run (bytes read + written). "GPU ms" is the replayed graph alone (no host work):
the floor an overlapped server step can reach. The server's TPOT over these is the server's own overhead.

``--prefill-lens 274 1308`` also times one fresh request's prefill forward of each length (and, with
``--prefill-batch N``, N requests of the first length in one forward), the way a prefill server runs an extend,
beside its compute roofline: 2 FLOPs per LM weight per token over the bf16 matmul rate measured in the same run
(attention's own FLOPs are left out, so the roofline is a floor). With ``--profile`` the first length's forward
is profiled on the host and the device: where a prefill's time goes when it is not in the GEMMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.engine.model_runner import ModelRunner
from epdserve.logging_setup import startup_summary
from epdserve.models.mrope import decode_positions


def _gpu_seconds(fn, reps: int) -> float:
    """Median GPU seconds of ``fn()`` over ``reps`` calls (CUDA events), after 3 untimed ones."""
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[3:])


def graph_us_per_call(calls: list, reps: int = 20) -> float:
    """Median microseconds per call of the zero-argument ``calls``, captured in order into one CUDA graph and
    replayed ``reps`` times (:func:`_gpu_seconds`); the first two run once before the capture, to compile and pick
    kernels outside it. A chain of calls over distinct weights makes them stream from HBM, not from L2."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return _gpu_seconds(graph.replay, reps) * 1e6 / len(calls)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written (median of ``reps``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _gpu_seconds(lambda: dst.copy_(src), reps)


def matmul_flops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """The device's bf16 matmul rate in FLOP/s: an ``n`` x ``n`` x ``n`` GEMM, median of ``reps``."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n ** 3 / _gpu_seconds(lambda: a @ b, reps)


def lm_weights(runner: ModelRunner) -> list[torch.nn.Parameter]:
    """The LM weights a step reads (the input embedding table aside, a lookup, unless tied to the LM head)."""
    model = runner.model
    table = None if runner.config.tie_word_embeddings else model.embed_tokens.weight
    return [p for p in model.parameters() if p is not table]


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts one MoE layer reads for ``tokens`` tokens each routed to ``top_k`` of
    ``num_experts``, routing uniform at random (random weights route about so; a trained router's skew reads
    fewer): ``E * (1 - (1 - k / E) ** tokens)``, since a token leaves a given expert out with probability
    ``1 - k / E``."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def _expert_params(runner: ModelRunner) -> set[int]:
    """ids of the routed experts' fused weights (``[E, ...]`` tensors under a module named ``experts``)."""
    return {id(p) for name, p in runner.model.named_parameters() if ".experts." in f".{name}"}


def active_weights(runner: ModelRunner, tokens: int, per_token: bool = False
                   ) -> list[tuple[torch.nn.Parameter, float]]:
    """Each LM weight (:func:`lm_weights`) with the share of it that a forward of ``tokens`` tokens reads, or
    with ``per_token`` that one token multiplies: 1 for a dense model's; an MoE model's routed experts in the
    share the tokens reach (:func:`expected_experts`; per token ``top_k / E``)."""
    cfg, experts, share = runner.config, _expert_params(runner), 1.0
    if experts:
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        share = k / E if per_token else expected_experts(E, k, tokens) / E
    return [(p, share if id(p) in experts else 1.0) for p in lm_weights(runner)]


def lm_params(runner: ModelRunner) -> float:
    """LM weights a token multiplies (an MoE model's active ones): :func:`active_weights` per token."""
    return sum(p.numel() * share for p, share in active_weights(runner, 1, per_token=True))


def prefill_batch(runner: ModelRunner, q_lens: list[int], slots: list[int] | None) -> ForwardBatch:
    """Fresh requests of ``q_lens`` random text tokens each on their own pages (from page 0 on), a prefill
    server's first extend of each; ``slots``: their state slots (hybrid models)."""
    ps, first, pages, out = runner.page_size, 0, [], []
    for q in q_lens:
        n = -(-q // ps)
        pages.append(list(range(first, first + n)))
        out.append(torch.arange(q) + first * ps)
        first += n
    if first > runner.num_pages:
        raise ValueError(f"{sum(q_lens)} prompt tokens need {first} pages, the pool has {runner.num_pages}")
    ids = torch.randint(0, min(1000, runner.config.vocab_size), (sum(q_lens),))
    pos = torch.cat([torch.arange(q) for q in q_lens]).expand(3, -1)
    return ForwardBatch(False, ids, pos, torch.cat(out), list(q_lens), list(q_lens), pages, state_slots=slots)


def time_prefill(runner: ModelRunner, q_lens: list[int], reps: int = 5) -> tuple[float, float]:
    """(wall s, GPU s) of one prefill forward of fresh requests of ``q_lens`` tokens (medians of ``reps`` after
    two untimed ones): wall from the host batch to the logits on the host, GPU between CUDA events around the
    forward, so their difference is host time the GPU waited through."""
    slots = None if runner.state_pool is None else [runner.state_pool.alloc() for _ in q_lens]
    batch = prefill_batch(runner, q_lens, slots)
    walls, gpus = [], []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        logits = runner.forward(batch)
        end.record()
        logits.argmax(-1).tolist()
        walls.append(time.perf_counter() - t0)
        gpus.append(start.elapsed_time(end) / 1e3)
    for slot in slots or ():
        runner.state_pool.free(slot)
    return statistics.median(walls[2:]), statistics.median(gpus[2:])


def profile_prefill(runner: ModelRunner, q_len: int, top: int = 25) -> dict:
    """One fresh ``q_len``-token prefill forward under torch.profiler (host and device): ``{"host": [...],
    "device": [...]}``, each the ``top`` ops by self time (``name``, ``calls``, ``us``), plus the number of
    kernel launches and of host-device synchronisations."""
    from torch.profiler import ProfilerActivity, profile

    slots = None if runner.state_pool is None else [runner.state_pool.alloc()]
    batch = prefill_batch(runner, [q_len], slots)
    runner.forward(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.forward(batch).argmax(-1).tolist()
    for slot in slots or ():
        runner.state_pool.free(slot)
    events = prof.key_averages()
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    dev = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[:top]
    count = {e.key: e.count for e in events}
    return dict(
        host=[dict(name=e.key[:90], calls=e.count, us=e.self_cpu_time_total) for e in host],
        device=[dict(name=e.key[:90], calls=e.count, us=e.self_device_time_total) for e in dev],
        kernel_launches=sum(c for k, c in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                   "cuLaunchKernelEx", "cudaLaunchKernelExC")),
        synchronizations=sum(c for k, c in count.items() if "Synchronize" in k or k == "cudaMemcpy"))


def step_bytes(runner: ModelRunner, kv_tokens: int, batch_size: int = 0) -> int:
    """Bytes a decode step must move: LM weights (the input embedding table aside) + ``kv_tokens`` tokens of KV
    (the attention layers' only: ``config.num_kv_layers``) read, + for hybrid models each of the ``batch_size``
    requests' linear-attention state (conv and recurrent, every DeltaNet layer) read and written back. MoE models:
    the routed experts count in the share that ``batch_size`` tokens are expected to reach
    (:func:`expected_experts`), the active experts' roofline."""
    cfg = runner.config
    weights = sum(p.numel() * p.element_size() * share
                  for p, share in active_weights(runner, max(batch_size, 1)))
    kv = kv_tokens * cfg.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * runner.kv_pool.buffer.element_size()
    state = 0 if runner.state_pool is None else 2 * batch_size * runner.state_pool.bytes_per_slot
    return weights + kv + state


def _decode_setup(runner: ModelRunner, batch_size: int, context: int, steps: int):
    """Pages (random KV) and state slots (random states) for ``batch_size`` requests at ``context`` tokens, room for
    ``steps`` more, and random first input ids. Returns ``(pages, tokens, slots)``."""
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
    return pages, tokens, slots


def _decode_batch(runner: ModelRunner, tokens, pages: list[list[int]], index: int, slots) -> ForwardBatch:
    """One decode step's batch: every request's input at sequence ``index``; ``tokens`` a list or a device tensor."""
    n, ps = len(pages), runner.page_size
    ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.int64)
    return ForwardBatch(
        True, ids, decode_positions(torch.full((n,), index), torch.zeros(n, dtype=torch.int64)),
        torch.tensor([p[index // ps] * ps + index % ps for p in pages], dtype=torch.int64),
        [1] * n, [index + 1] * n, pages, state_slots=slots)


def time_steps(runner: ModelRunner, batch_size: int, context: int, steps: int,
               overlap: bool = False) -> tuple[list[float], list[int]]:
    """Wall seconds of each of ``steps`` greedy decode steps of ``batch_size`` requests starting at ``context``
    tokens, and the last step's tokens.

    ``overlap=False``: one step after the other, each ending in ``.tolist()`` (host work and GPU time add up).
    ``overlap=True``: as the decode server's overlap scheduling runs them: a step's input ids are the previous
    step's argmax, still on the device, its host work (batch, plan, launch) runs while the previous step is on the
    GPU, and the host waits for a step only once the next one is launched; in the steady state a step's wall time
    is then the larger of its host time and its GPU time (issue 44's "step wall time within 10 % of its GPU
    time")."""
    pages, tokens, slots = _decode_setup(runner, batch_size, context, steps)
    cuda = runner.device.type == "cuda"
    out, last = [], time.perf_counter()
    previous = None  # overlap on CUDA: the event recorded after the step in flight
    if overlap:
        tokens = torch.tensor(tokens, dtype=torch.int64, device=runner.device)
    for step in range(steps):
        batch = _decode_batch(runner, tokens, pages, context + step, slots)
        if not overlap:
            tokens = runner.forward(batch).argmax(-1).tolist()
        else:
            tokens = runner.forward(batch).argmax(-1)
            if cuda:
                done = torch.cuda.Event()
                done.record()
                if previous is not None:
                    previous.synchronize()  # the previous step: its tokens would go to the clients now
                previous = done
        now = time.perf_counter()
        out.append(now - last)
        last = now
    if overlap:
        tokens = tokens.tolist()
    for slot in slots or ():
        runner.state_pool.free(slot)
    return out, tokens


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


def critical_path(kernels: list[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """Each kernel's share of the stream's critical path: ``kernels`` are ``(name, start, end)`` on one stream, in
    any order and any time unit; returns ``({name: exclusive time}, idle time)`` in that unit.

    A kernel's exclusive time is the part of ``[start, end]`` after every earlier kernel has ended: under
    programmatic dependent launch (PDL) a kernel starts while the one before it is still running and waits for it
    inside (``griddepcontrol.wait``), so its own duration double-counts its predecessor's tail, and the durations
    of a PDL chain add up to more than the step. The exclusive times and the idle gaps between kernels add up to
    the span from the first start to the last end.
    """
    exclusive: dict[str, float] = {}
    idle = 0.0
    done = None
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        if done is None:
            done = start
        idle += max(0.0, start - done)
        exclusive[name] = exclusive.get(name, 0.0) + max(0.0, end - max(start, done))
        done = max(done, end)
    return exclusive, idle


def profile_replays(runner: ModelRunner, batch_size: int, reps: int = 10, top: int = 25) -> list[dict]:
    """The GPU kernels of ``reps`` replays of the graph serving ``batch_size`` (torch.profiler, CUDA activity),
    the ``top`` by critical-path time: ``[{name, calls_per_step, us_per_step, exclusive_us_per_step}]``, where
    ``us_per_step`` is the kernels' own durations and ``exclusive_us_per_step`` their share of the step once the
    overlap of PDL launches is taken out (:func:`critical_path`). Call right after :func:`time_steps`, as
    :func:`graph_gpu_time`. Empty without graphs."""
    if runner.graphs is None or batch_size > runner.graphs.max_bs:
        return []
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph = runner.graphs.graphs[next(s for s in runner.graphs.sizes if s >= batch_size)]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    spans = [(e.name[:90], e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA]
    exclusive, _ = critical_path(spans)
    rows = [dict(name=e.key[:90], calls_per_step=e.count / reps, us_per_step=e.device_time_total / reps,
                 exclusive_us_per_step=exclusive.get(e.key[:90], 0.0) / reps)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["exclusive_us_per_step"])[:top]


def run_prefills(runner: ModelRunner, args) -> dict:
    """The ``--prefill-lens`` / ``--prefill-batch`` rows (and ``--profile``'s breakdown of the first length)."""
    flops = matmul_flops(runner.device)
    print(f"bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    shapes = [[n] for n in args.prefill_lens]
    if args.prefill_batch > 1:
        shapes.append([args.prefill_lens[0]] * args.prefill_batch)
    rows = []
    for q_lens in shapes:
        wall, gpu = time_prefill(runner, q_lens)
        roof = 2 * lm_params(runner) * sum(q_lens) / flops
        graphs = runner.prefill_graphs
        graphed = graphs is not None and len(q_lens) == 1 and q_lens[0] <= graphs.max_tokens
        rows.append(dict(q_lens=q_lens, tokens=sum(q_lens), wall_ms=wall * 1e3, gpu_ms=gpu * 1e3,
                         roofline_ms=roof * 1e3, roofline_fraction=roof / wall, cuda_graph=graphed))
        print(f"prefill of {len(q_lens)} x {q_lens[0]} tokens: {wall * 1e3:.2f} ms", flush=True)
    profile = profile_prefill(runner, args.prefill_lens[0]) if args.profile else None
    return dict(matmul_flops=flops, prefill_rows=rows, prefill_profile=profile)


def print_prefills(prefills: dict) -> None:
    """Print :func:`run_prefills`' table (nothing when it did not run)."""
    if not prefills:
        return
    print(f"prefill forwards (bf16 matmul {prefills['matmul_flops'] / 1e12:.0f} TFLOP/s):")
    print(f"{'requests':>9} {'tokens':>7} {'graph':>6} {'wall ms':>9} {'GPU ms':>8} {'roofline ms':>12} "
          f"{'of roofline':>12}")
    for r in prefills["prefill_rows"]:
        print(f"{len(r['q_lens']):>9} {r['tokens']:>7} {'yes' if r['cuda_graph'] else 'no':>6} {r['wall_ms']:>9.2f} "
              f"{r['gpu_ms']:>8.2f} {r['roofline_ms']:>12.2f} {100 * r['roofline_fraction']:>11.1f}%")
    if (p := prefills["prefill_profile"]) is not None:
        print(f"prefill profile: {p['kernel_launches']} kernel launches, {p['synchronizations']} synchronisations")
        for side in ("host", "device"):
            print(f"  top {side} ops by self time (us, calls)")
            for e in p[side]:
                print(f"  {e['us']:9.1f} {e['calls']:6d}  {e['name']}")


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
    ap.add_argument("--prefill-lens", type=int, nargs="*", default=[],
                    help="also time one fresh request's prefill forward of each of these prompt lengths")
    ap.add_argument("--prefill-batch", type=int, default=0,
                    help="and N requests of the first --prefill-lens length in one forward")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=2048,
                    help="one-request prefills up to this many tokens replay CUDA graphs, as a prefill server's "
                         "--cuda-graph-max-tokens (0 or --disable-cuda-graph: none)")
    ap.add_argument("--decode-attention-backend", default="auto", choices=["auto", "flashinfer", "triton"],
                    help="decode batches' attention kernel, as the servers' flag of that name")
    ap.add_argument("--output-json", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    t0 = time.monotonic()
    runner = ModelRunner(args.model_path, device=dev, dtype=torch.bfloat16, num_pages=args.num_pages, page_size=16,
                         cuda_graph_max_bs=0 if args.disable_cuda_graph else max(args.batch_sizes),
                         prefill_graph_max_tokens=0 if args.disable_cuda_graph else args.prefill_graph_max_tokens,
                         num_state_slots=max(args.batch_sizes + [args.prefill_batch]),
                         decode_attention_backend=args.decode_attention_backend)
    print(f"model loaded in {time.monotonic() - t0:.1f} s ({startup_summary(runner.startup_s)})", flush=True)
    bw = copy_bandwidth(dev)
    prefills = run_prefills(runner, args) if args.prefill_lens else {}
    rows = []
    for bs in args.batch_sizes:
        times = time_steps(runner, bs, args.context, args.steps)[0][4:]  # the first steps warm caches up
        median = statistics.median(times)
        overlapped = statistics.median(time_steps(runner, bs, args.context, args.steps, overlap=True)[0][4:])
        gpu = graph_gpu_time(runner, bs)
        kv_tokens = bs * (args.context + args.steps // 2)
        roof = step_bytes(runner, kv_tokens, bs) / bw
        kernels = profile_replays(runner, bs) if args.profile else []
        rows.append(dict(batch_size=bs, context=args.context, step_ms=median * 1e3, overlapped_step_ms=overlapped * 1e3,
                         graph_gpu_ms=None if gpu is None else gpu * 1e3, roofline_ms=roof * 1e3,
                         roofline_fraction=roof / median, tokens_per_s=bs / median,
                         cuda_graph=runner.graphs is not None, kernels=kernels))
    print(f"device: {torch.cuda.get_device_name(dev)}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write); "
          f"CUDA graphs: {'on' if runner.graphs is not None else 'off'}")
    print(f"{'batch':>6} {'step ms':>9} {'overlapped':>11} {'GPU ms':>8} {'roofline ms':>12} {'of roofline':>12} "
          f"{'tok/s':>10}")
    for r in rows:
        gpu = "-" if r["graph_gpu_ms"] is None else f"{r['graph_gpu_ms']:.3f}"
        print(f"{r['batch_size']:>6} {r['step_ms']:>9.3f} {r['overlapped_step_ms']:>11.3f} {gpu:>8} "
              f"{r['roofline_ms']:>12.3f} {100 * r['roofline_fraction']:>11.1f}% {r['tokens_per_s']:>10.0f}")
    for r in rows:
        if r["kernels"]:
            print(f"batch {r['batch_size']}: top GPU kernels per step (us on the critical path, us of their own "
                  f"durations, calls)")
            for k in r["kernels"]:
                print(f"  {k['exclusive_us_per_step']:9.1f} {k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  "
                      f"{k['name']}")
    print_prefills(prefills)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), copy_bandwidth=bw, model_path=args.model_path,
                           decode_attention_backend=args.decode_attention_backend, rows=rows, **prefills), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
