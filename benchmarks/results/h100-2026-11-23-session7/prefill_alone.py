"""One-request prefill (350 tokens, 256 image rows), alone in a process: eager vs CUDA graph, GPU time by events."""
import sys, time, statistics, torch
from epdserve.model_runner import ModelRunner
from epdserve.forward_batch import ForwardBatch
from epdserve.models.mrope import mrope_positions
from epdserve.sampling import sample
from epdserve.messages import SamplingParams
dev = torch.device("cuda")
r = ModelRunner(sys.argv[1], device=dev, dtype=torch.bfloat16, num_pages=4000, page_size=16,
                prefill_graph_max_tokens=2048)
EMB = torch.randn(256, r.config.hidden_size).to(torch.bfloat16)
def one(graph, n=350, cached=16):
    pos, _ = mrope_positions(n, [(15, (1, 32, 32))], 2)
    m = torch.zeros(n - cached, dtype=torch.bool); m[:255] = True
    emb = EMB[:int(m.sum())]
    pages = list(range(-(-n // 16)))
    b = ForwardBatch(False, torch.arange(n - cached) % 1000 + 100, pos[:, cached:], torch.arange(cached, n),
                     [n - cached], [n], [pages], emb, m, [("r", "h", 0, int(m.sum()))])
    saved = r.prefill_graphs
    if not graph: r.prefill_graphs = None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter(); s.record(); logits = r.forward(b); e.record(); t1 = time.perf_counter()
    sample(logits, [SamplingParams(temperature=0.0)], [None]).tolist(); t2 = time.perf_counter()
    r.prefill_graphs = saved
    return (t1 - t0) * 1e3, s.elapsed_time(e), (t2 - t0) * 1e3
for g in (True, False, True, False):
    for _ in range(3): one(g)
    rows = [one(g) for _ in range(20)]
    print(f"{'graph' if g else 'eager'}: launch {statistics.median(x[0] for x in rows):6.2f} ms, GPU (events) "
          f"{statistics.median(x[1] for x in rows):6.2f} ms, to first token {statistics.median(x[2] for x in rows):6.2f} ms"
          f"  (GPU min {min(x[1] for x in rows):.2f} max {max(x[1] for x in rows):.2f})")
# the server's pattern: the process sleeps between requests (c1: ~150 ms per request), one thread vs the default
for nt in (torch.get_num_threads(), 1, torch.get_num_threads(), 1):
    torch.set_num_threads(nt)
    rows = []
    for _ in range(12):
        time.sleep(0.15); rows.append(one(True))
    print(f"graph after 150 ms idle, {nt:2d} torch threads: launch {statistics.median(x[0] for x in rows):6.2f} ms, "
          f"to first token {statistics.median(x[2] for x in rows):6.2f} ms")
# GPU time alone: the forward queued behind a sleep, so the host is ahead
for g in (True, False):
    one(g); torch.cuda.synchronize(); torch.cuda._sleep(300_000_000)
    print(f"{'graph' if g else 'eager'} queued behind a GPU sleep: GPU {one(g)[1]:.2f} ms")
