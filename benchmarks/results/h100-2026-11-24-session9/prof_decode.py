"""Profile: one decode graph replay at batch 128 (kernel table), then decode attention alone, variants side by side."""
import sys, statistics, torch, flashinfer
from torch.profiler import profile, ProfilerActivity
from epdserve.model_runner import ModelRunner
from epdserve.bench.step import time_steps, graph_gpu_time

path = sys.argv[1]
dev = torch.device("cuda")
runner = ModelRunner(path, device=dev, dtype=torch.bfloat16, num_pages=0, page_size=16, cuda_graph_max_bs=128)
for bs, ctx in ((128, 400), (32, 600), (1, 400)):
    t = time_steps(runner, bs, ctx, 24)[4:]
    g = graph_gpu_time(runner, bs)
    print(f"bs {bs} ctx {ctx}: step {statistics.median(t)*1e3:.3f} ms, graph GPU {g*1e3:.3f} ms", flush=True)
    if bs == 128:
        graph = runner.graphs.graphs[128]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=90))

def bench(fn, reps=50):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / reps * 1e3  # us

qh, kh, hd = 16, 2, 128
for bs, ctx in ((128, 400), (128, 1024), (32, 600), (1, 400)):
    for ps in (16, 1, 64):
        per = -(-ctx // ps); npages = per * bs
        kv = torch.randn(npages, 2, ps, kh, hd, dtype=torch.bfloat16, device=dev)
        indptr = torch.arange(0, bs + 1, dtype=torch.int32, device=dev) * per
        idx = torch.arange(npages, dtype=torch.int32, device=dev)
        last = torch.full((bs,), ctx - (per - 1) * ps, dtype=torch.int32, device=dev)
        q = torch.randn(bs, qh, hd, dtype=torch.bfloat16, device=dev)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        res = []
        for name, kw in (("cuda-core", {}), ("tensor-core", {"use_tensor_cores": True})):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", **kw)
            w.plan(indptr, idx, last, qh, kh, hd, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            res.append(f"{name} {bench(lambda: w.run(q, kv)):.1f} us")
        mb = bs * ctx * kh * hd * 2 * 2 / 1e6
        print(f"attention bs {bs} ctx {ctx} page {ps} ({mb:.1f} MB KV): " + ", ".join(res), flush=True)
        del kv
