"""The split-KV decode attention kernel (Triton) against a float64 reference of the same inputs: on CPU through
Triton's interpreter in float32 (its bf16 dot is not the GPU's), on CUDA in bf16, eagerly and inside a captured
CUDA graph replayed with other KV lengths."""

from __future__ import annotations

import math

import pytest
import torch

from epdserve.attention import triton_decode as mod


def _reference(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, scale):
    """``(out, out_abs)`` in float64: softmax attention per request over its gathered pages, KV heads repeated for
    their query heads; ``out_abs`` is the same weights applied to ``|v|`` (the scale of the probability-rounding
    error). Rows with no tokens are zeros."""
    B, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, hq, d, dtype=torch.float64, device=q.device)
    out_abs = torch.zeros_like(out)
    for b, n in enumerate(kv_lens.tolist()):
        if n == 0:
            continue
        t = torch.arange(n, device=q.device)
        pages = kv_indices[int(kv_indptr[b]) + t // page_size].long()
        k = k_cache[pages, t % page_size].double().repeat_interleave(hq // hkv, dim=1)
        v = v_cache[pages, t % page_size].double().repeat_interleave(hq // hkv, dim=1)
        w = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v)
        out_abs[b] = torch.einsum("hn,nhd->hd", w, v.abs())
    return out, out_abs


def _case(lens, group, hkv, d, page_size, dtype, device="cpu", seed=0, interleaved=False, spare_pages=5):
    """A batch over shuffled, non-contiguous pages: q a column view of a fused ``[B, (HQ + 2 HKV) * D]`` qkv
    buffer, k/v views of one buffer (``[2, pages, ...]``, or ``[pages, 2, ...]`` with ``interleaved``); the first
    request holds one page more than its length needs (the kernel must go by kv_lens, not the page count)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hq, B = group * hkv, len(lens)
    npages = [math.ceil(n / page_size) + (b == 0) for b, n in enumerate(lens)]
    used = sum(npages)
    num_pages = used + spare_pages
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32, device=device)
    indices = torch.randperm(num_pages, generator=g, device=device)[:used].to(torch.int32)
    shape = (num_pages, 2, page_size, hkv, d) if interleaved else (2, num_pages, page_size, hkv, d)
    kv = torch.randn(shape, generator=g, device=device).to(dtype)
    k_cache, v_cache = (kv[:, 0], kv[:, 1]) if interleaved else (kv[0], kv[1])
    # Twice unit variance: peakier softmax rows, so the running max and rescaling matter.
    qkv = (torch.randn(B, (hq + 2 * hkv) * d, generator=g, device=device) * 2).to(dtype)
    q = qkv[:, : hq * d].view(B, hq, d)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, indptr, indices, lens_t


@pytest.mark.parametrize("lens,group,hkv,d,page_size,splits,interleaved", [
    ([513, 17, 0, 1], 8, 2, 128, 16, 1, False),
    ([1, 15, 100, 513], 8, 2, 128, 16, 16, True),
    ([16, 17, 0, 100], 7, 4, 64, 1, 4, False),
    ([513, 1, 15, 16], 1, 4, 64, 16, 4, False),
    ([15, 17, 513, 0], 7, 2, 64, 16, 16, False),
    ([1, 100, 16], 1, 2, 64, 1, 1, True),
    ([100, 3, 0], 80, 1, 16, 16, 2, False),
])
def test_matches_reference_on_the_interpreter(interpreter, lens, group, hkv, d, page_size, splits, interleaved):
    q, k_cache, v_cache, indptr, indices, lens_t = _case(lens, group, hkv, d, page_size, torch.float32,
                                                        interleaved=interleaved)
    assert q.stride(0) == (group + 2) * hkv * d and not q.is_contiguous()
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = mod.decode_attention(q, k_cache, v_cache, indptr, indices, lens_t, d**-0.5, splits, out=out)
    assert got is out and got.dtype == torch.float32
    ref, _ = _reference(q, k_cache, v_cache, indptr, indices, lens_t, d**-0.5)
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    print(f"lens {lens} group {group} hkv {hkv} d {d} page {page_size} splits {splits}: max error {err:.2e} of "
          f"max |ref|")
    # float32 throughout (the interpreter's dot is numpy's): rounding of the logits, exp2 and the rescaling over
    # <= 513 tokens stays ~1e-6 of the output scale; 1e-4 leaves 100x margin and still catches any wrong token,
    # page, head or weight, each of which moves the output by >~1e-3.
    assert err <= 1e-4
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b])), "a padding row must be zeros"


@pytest.mark.parametrize("early", [False, True])
def test_both_load_orders_match_reference_on_the_interpreter(interpreter, early):
    """The split's first block loaded before the PDL wait (all but each request's newest token, that one after it)
    or after it: the same attention, with splits of one block and of several, empty splits and a padding row."""
    q, k_cache, v_cache, indptr, indices, lens_t = _case([513, 33, 0, 1, 32], 4, 2, 64, 16, torch.float32, seed=3)
    ref, _ = _reference(q, k_cache, v_cache, indptr, indices, lens_t, 64**-0.5)
    for splits, block_n in ((16, 16), (4, 32), (1, 64)):
        out = torch.full_like(q, float("nan"))
        mod._launch(q, k_cache, v_cache, indptr, indices, lens_t, 64**-0.5, splits, out, block_n=block_n,
                    early=early)
        assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-4, (splits, block_n)


def test_fresh_output_is_contiguous_in_the_query_dtype(interpreter):
    q, k_cache, v_cache, indptr, indices, lens_t = _case([5, 0], 4, 1, 16, 4, torch.float32)
    got = mod.decode_attention(q, k_cache, v_cache, indptr, indices, lens_t, 0.25, 4)
    assert got.shape == q.shape and got.is_contiguous() and got.dtype == q.dtype
    ref, _ = _reference(q, k_cache, v_cache, indptr, indices, lens_t, 0.25)
    assert float((got.double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_num_kv_splits():
    assert mod.num_kv_splits(1, 2, 132) == 32  # 132 wanted, capped
    assert mod.num_kv_splits(32, 2, 132) == 8  # 264 / 64 = 4.1 -> 8
    assert mod.num_kv_splits(128, 2, 132) == 2
    assert mod.num_kv_splits(132, 2, 132) == 1 and mod.num_kv_splits(1024, 8, 132) == 1
    assert mod.num_kv_splits(1, 1, 132, max_splits=48) == 32  # a power of two within max_splits
    for bs in range(1, 300):
        s = mod.num_kv_splits(bs, 2, 132)
        assert s & (s - 1) == 0 and 1 <= s <= 32
        assert bs * 2 * s >= 264 or s == 32
        assert s == 1 or bs * 2 * (s // 2) < 264, "the smallest power of two that fills the SMs twice"
    with pytest.raises(ValueError, match="positive"):
        mod.num_kv_splits(0, 2, 132)


def test_bad_inputs_raise():
    q, k, v, indptr, indices, lens = _case([5, 3], 4, 2, 16, 4, torch.float32)
    call = mod.decode_attention
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        call(q[:, :7], k, v, indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="one dtype"):
        call(q, k.half(), v, indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="one dtype"):
        call(q.double(), k.double(), v.double(), indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        call(q[..., :12], k[..., :12], v[..., :12], indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        call(q, k[..., :8], v[..., :8], indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="power-of-two page size"):
        call(q, k[:, :3], v[:, :3], indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="int32"):
        call(q, k, v, indptr.long(), indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="int32"):
        call(q, k, v, indptr, indices, lens.long(), 0.25, 2)
    with pytest.raises(ValueError, match="kv_indptr"):
        call(q, k, v, indptr[:2], indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="kv_lens"):
        call(q, k, v, indptr, indices, lens[:1], 0.25, 2)
    with pytest.raises(ValueError, match="one shape"):
        call(q, k, v[:, :, :1], indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="one shape"):
        call(q[0], k, v, indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="head_dim contiguous"):
        call(torch.randn(2, 16, 8).transpose(1, 2), k, v, indptr, indices, lens, 0.25, 2)
    with pytest.raises(ValueError, match="num_splits"):
        call(q, k, v, indptr, indices, lens, 0.25, 0)
    with pytest.raises(ValueError, match="out"):
        call(q, k, v, indptr, indices, lens, 0.25, 2, out=torch.empty(2, 8, 16, dtype=torch.float16))


def _bf16_bound(ref, ref_abs):
    """Per-element error bound of the bf16 kernel: the output's own rounding (half an ulp, <= 2**-8 of |ref|) plus
    the probabilities rounded to bf16 before the P.V product (each term off by <= 2**-9 relative, so <= 2**-9 of
    the weighted mean of |v|), with a factor 2 of slack on each; the logits and the merge are float32."""
    return 2 * 2.0**-8 * ref.abs() + 2 * 2.0**-9 * ref_abs + 1e-6


def _check_bf16(got, ref, ref_abs, what):
    assert not got.isnan().any(), what
    excess = ((got.double() - ref).abs() / _bf16_bound(ref, ref_abs)).max()
    ulps = float((got.double() - ref).abs().max() / (2.0**-7 * ref.abs().max()))
    print(f"{what}: worst error {float(excess):.2f} of the bound, {ulps:.2f} bf16 ulps of max |ref|")
    assert float(excess) <= 1.0, what


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("context", [512, 2048])
def test_bf16_on_cuda(batch, context):
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mod.num_kv_splits(batch, 2, num_sms)
    lens = [context - (b % 7) for b in range(batch)]
    q, k, v, indptr, indices, lens_t = _case(lens, 8, 2, 128, 16, torch.bfloat16, device="cuda", seed=batch)
    got = mod.decode_attention(q, k, v, indptr, indices, lens_t, 128**-0.5, splits)
    ref, ref_abs = _reference(q, k, v, indptr, indices, lens_t, 128**-0.5)
    _check_bf16(got, ref, ref_abs, f"B={batch} context {context} splits {splits}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 8])
def test_cuda_graph_replays_with_other_kv_lengths(splits):
    """One capture at 512 tokens per request, replayed at other lengths (1 to 2048, a padding row) and other page
    ids written into the same index buffers: the grid and the buffers stay, the kernel follows kv_lens."""
    batch, context = 32, 2048
    q, k, v, indptr, indices, lens_t = _case([context] * batch, 8, 2, 128, 16, torch.bfloat16, device="cuda",
                                             seed=7, spare_pages=64)
    lens_t.fill_(512)
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    mod.decode_attention(q, k, v, indptr, indices, lens_t, 128**-0.5, splits, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.decode_attention(q, k, v, indptr, indices, lens_t, 128**-0.5, splits, out=out)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        new_lens = torch.randint(1, context + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
        new_lens[step] = 0
        new_lens[step + 1] = context
        lens_t.copy_(new_lens)
        num_pages = k.shape[0]
        indices.copy_(torch.randperm(num_pages, generator=g, device="cuda")[: indices.numel()].to(torch.int32))
        q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(q.dtype) * 2)
        out.fill_(float("nan"))
        graph.replay()
        ref, ref_abs = _reference(q, k, v, indptr, indices, lens_t, 128**-0.5)
        _check_bf16(out, ref, ref_abs, f"graph replay {step} splits {splits}")
        assert torch.equal(out[step], torch.zeros_like(out[step]))


def test_auto_decode_kernel_is_triton_where_measured():
    """``--decode-attention-backend auto``: the Triton kernel up to head_dim 128 (measured faster there), flashinfer's
    decode above (Qwen3.5's 256, not measured); the named kernels as given; an unknown name refused."""
    from epdserve.attention.triton_decode_plan import decode_kernel

    assert [decode_kernel("auto", d) for d in (64, 128, 256)] == ["triton", "triton", "flashinfer"]
    assert decode_kernel("flashinfer", 128) == "flashinfer" and decode_kernel("triton", 256) == "triton"
    with pytest.raises(ValueError, match="unknown decode attention backend"):
        decode_kernel("fa3", 128)


def test_graph_plan_packs_one_copy_that_reads_as_the_eager_plan():
    """TritonDecode.prepare for a CUDA graph writes indptr, lengths and indices into one static buffer (one copy a
    step) at fixed offsets; the views the captured kernels read equal the eager plan's tensors, for a batch smaller
    than the largest graph and again for another batch (the same views, new contents)."""
    from types import SimpleNamespace

    from epdserve.attention.triton_decode_plan import TritonDecode
    from epdserve.kvcache.page_table import paged_kv_csr

    plan = object.__new__(TritonDecode)  # no CUDA device here: the fields __init__ would read from it
    plan.kv_pool = SimpleNamespace(device=torch.device("cpu"), num_pages=64, num_kv_heads=2)
    plan.scale, plan.num_sms, plan._plan = 1.0, 132, None
    plan.enable_cuda_graphs(8)
    views = None
    for page_table, kv_lens in (([[3, 9, 4], [7], [12, 13]], [40, 5, 17]), ([[1], [2, 6]], [16, 20])):
        indptr, indices, _ = paged_kv_csr(page_table, kv_lens, 16)
        plan.prepare(indptr, indices, kv_lens, cuda_graph=False)
        eager = plan._plan
        plan.prepare(indptr, indices, kv_lens, cuda_graph=True)
        graph = plan._plan
        assert graph[3] == eager[3]
        for got, want in zip(graph[:3], eager[:3]):
            assert torch.equal(got[:want.numel()], want)
        assert graph[0].numel() == len(kv_lens) + 1 and graph[2].numel() == len(kv_lens)
        if views is None:
            views = [t.data_ptr() for t in graph[:3]]
        assert [t.data_ptr() for t in graph[:3]] == views  # the pointers a captured graph holds
