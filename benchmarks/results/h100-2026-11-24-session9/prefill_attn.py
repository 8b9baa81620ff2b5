"""Prefill attention alone, one request (causal, paged 16, GQA 16/2): flashinfer auto (FA3 on Hopper) vs FA2."""
import torch, flashinfer
from torch.profiler import profile, ProfilerActivity
dev = torch.device("cuda")

def kernel_us(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / reps

qh, kh, hd, ps = 16, 2, 128, 16
ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
for n, bs in ((350, 1), (1274, 1), (542, 8)):
    per = -(-n // ps); npages = per * bs
    kv = torch.randn(npages, 2, ps, kh, hd, dtype=torch.bfloat16, device=dev)
    kv_indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * per
    qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * n
    idx = torch.arange(npages, dtype=torch.int32, device=dev)
    last = torch.full((bs,), n - (per - 1) * ps, dtype=torch.int32, device=dev)
    q = torch.randn(bs * n, qh, hd, dtype=torch.bfloat16, device=dev)
    ref = None
    for backend in ("auto", "fa2"):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=backend)
        w.plan(qo_indptr, kv_indptr, idx, last, qh, kh, hd, ps, causal=True, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
        out = w.run(q, kv); ref = out if ref is None else ref
        print(f"prefill {bs} x {n} tokens: {backend} {kernel_us(lambda: w.run(q, kv)):.1f} us per layer "
              f"(err {(out.float() - ref.float()).abs().max().item():.1e})", flush=True)
