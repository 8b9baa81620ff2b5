"""Decode attention alone (GQA 16/2, head_dim 128, bf16, NHD pages of 16): kernel time per call from the profiler."""
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
variants = [("cuda-core", {}, {}), ("cuda-core graph-mode", {"use_cuda_graph": True}, {}),
            ("tc fa2", {"use_tensor_cores": True, "backend": "fa2"}, {}),
            ("tc fa2 no-split", {"use_tensor_cores": True, "backend": "fa2"}, {"disable_split_kv": True}),
            ("tc fa3", {"use_tensor_cores": True, "backend": "fa3"}, {})]
for bs, ctx in ((1, 400), (32, 600), (128, 400), (128, 1024)):
    per = -(-ctx // ps); npages = per * bs
    kv = torch.randn(npages, 2, ps, kh, hd, dtype=torch.bfloat16, device=dev)
    indptr = torch.arange(0, bs + 1, dtype=torch.int32, device=dev) * per
    idx = torch.arange(npages, dtype=torch.int32, device=dev)
    last = torch.full((bs,), ctx - (per - 1) * ps, dtype=torch.int32, device=dev)
    q = torch.randn(bs, qh, hd, dtype=torch.bfloat16, device=dev)
    ref, res = None, []
    for name, kw, pkw in variants:
        try:
            extra = {}
            if kw.get("use_cuda_graph"):
                extra = dict(paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=idx.clone(),
                             paged_kv_last_page_len_buffer=last.clone())
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", **kw, **extra)
            w.plan(indptr, idx, last, qh, kh, hd, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **pkw)
            out = w.run(q, kv)
            ref = out if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            print(f"  bs {bs} ctx {ctx}: {name} {kernel_us(lambda: w.run(q, kv)):.1f}us (err {err:.1e})", flush=True)
        except Exception as e:
            print(f"  bs {bs} ctx {ctx}: {name} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    mb = bs * ctx * kh * hd * 2 * 2 / 1e6
    print(f"bs {bs} ctx {ctx} ({mb:.1f} MB KV, {mb / 3.0:.1f} us at 3 TB/s): " + "; ".join(res), flush=True)
    del kv
