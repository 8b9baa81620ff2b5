"""Decode attention (one query token per request) over a paged KV cache with grouped-query heads, in two Triton
launches whose grid does not depend on the context lengths, so one captured CUDA graph serves any of them.

Why: flashinfer's tensor-core decode took, per layer on an H200 (16 query / 2 KV heads, head_dim 128, page 16,
bf16), 7.3 us for 1 request x 512 tokens of context (an attention kernel plus PersistentVariableLengthMergeStates),
14.6 us at 32 x 512 and 28.2 us at 128 x 512. Decode attention reads every KV byte once and does ~1 FLOP per byte,
so it is bound by memory bandwidth and by how many multiprocessors are kept streaming: a token is 1 KiB of K and V
here, 67 MB at 128 x 512 (28.2 us is 2.4 TB/s; ~16 us at the ~4.3 TB/s a device copy reaches). This kernel, same
shapes and H200, each layer's own cache in turn inside one CUDA graph (so not out of L2): 5.1, 11.4 and 24.0 us;
25.1 us at 32 x 2048 and 71 us at 128 x 2048 (268 MB, 3.8 TB/s). At one request the two launches' fixed cost
dominates.

Algorithm: split-KV ("Flash-Decoding", Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
inference"), laid out as in SGLang's two-stage Triton decode (``_fwd_grouped_kernel_stage1`` and
``_fwd_kernel_stage2`` of sgl-project/sglang ``python/sglang/srt/layers/attention/triton_ops/decode_attention.py``,
itself from ModelTC/lightllm; Apache-2.0, which this adaptation keeps for the parts taken from it):

- stage 1, one program per (request, KV head, split): the split's contiguous token range, ``ceil(kv_len /
  num_splits)`` rounded up to a multiple of ``BLOCK_N``, is streamed ``BLOCK_N`` tokens at a time (each token's
  page looked up in the CSR page table) against all the query heads of the group at once: the group's rows are
  padded to >= 16 so both products go through ``tl.dot`` (tensor cores) and each K/V byte is read once per group,
  not once per query head. Online softmax in float32 (exp2, ``scale * log2(e)`` folded into the logits) gives a
  normalised partial output and its log2-sum-exp per head; a split with no tokens writes zeros and lse = -inf.
  With ``early`` (:func:`decode_attention`), under programmatic dependent launch the split's first block, but for
  each request's newest token, loads before ``griddepcontrol.wait`` (the kernels before it in a decode step write
  only q and that token's K and V), so the KV stream starts while the layer's qkv kernel still runs.
- stage 2, one program per (request, query head): the partial outputs weighted by ``exp2(lse - max lse)``; the
  splits with lse = -inf weigh nothing and are not read, and a request with no tokens at all (a padding row) gets
  zeros.

With ``num_splits == 1`` stage 1 writes the output itself and stage 2 is not launched. The grid is
``(B, HKV * ceil(G / 64), num_splits)`` then ``(B, HQ)``: fixed by the shapes and ``num_splits``; the split ranges
are computed from ``kv_lens`` inside the kernel.

Shapes and dtypes: q ``[B, HQ, D]``; k_cache and v_cache ``[num_pages, page_size, HKV, D]`` (NHD pages, flashinfer's
layout); bf16, fp16, or fp32 (Triton's CPU interpreter, tests); int32 ``kv_indptr [B + 1]``, ``kv_indices``,
``kv_lens [B]``; the partial outputs ``[B, HQ, num_splits, D]`` and lse ``[B, HQ, num_splits]`` in float32.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from epdserve.device import supports_pdl

_LOG2E = 1.4426950408889634
# tl.dot wants at least 16 rows; past 64 a group is cut into several programs so the accumulator stays in registers.
_MIN_HEAD_ROWS, _MAX_HEAD_ROWS = 16, 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _kernel():
    """The two jitted kernels ``(split_kernel, merge_kernel)``; Triton imported on first use."""
    import triton
    import triton.language as tl

    return _split_kernel(triton, tl), _merge_kernel(triton, tl)


# Both kernels reduce through tl.reduce with the standard library's own combine functions, make zeros through
# tl.full and divide without tl.cdiv: tl.sum, tl.max, tl.zeros and tl.cdiv are jitted when Triton is first imported,
# so they run under the interpreter only if TRITON_INTERPRET was set before that (the tests set it later). The
# interpreter knows these two combine functions by identity and reduces with numpy (any other: element by element,
# in Python); on the GPU this is exactly what tl.sum and tl.max compile to.


def _split_kernel(triton, tl):
    """Stage 1, one program per (request, KV head, chunk of <= 64 query rows, split); built by :func:`_kernel`."""

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, kv_indptr, kv_indices, kv_lens, part_ptr, lse_ptr, out_ptr, qk_scale,
                     stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                     stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                     GROUP: tl.constexpr, HEAD_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                     PRECISION: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        chunks: tl.constexpr = (GROUP + HEAD_ROWS - 1) // HEAD_ROWS
        kv_head = tl.program_id(1) // chunks
        split = tl.program_id(2)
        rows = (tl.program_id(1) % chunks) * HEAD_ROWS + tl.arange(0, HEAD_ROWS)
        row_ok = rows < GROUP
        heads = kv_head * GROUP + rows
        offs_d = tl.arange(0, HEAD_DIM)
        if PDL and not EARLY:  # q and the KV were written by the kernels before this one (supports_pdl)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        kv_len, first_page = tl.load(kv_lens + b), tl.load(kv_indptr + b)
        # Whole BLOCK_N blocks per split: only the last block of a request is partial (masked).
        per_split = ((kv_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start, end = split * per_split, tl.minimum((split + 1) * per_split, kv_len)
        k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
        m, denom = tl.full([HEAD_ROWS], float("-inf"), tl.float32), tl.full([HEAD_ROWS], 0.0, tl.float32)
        acc = tl.full([HEAD_ROWS, HEAD_DIM], 0.0, tl.float32)
        if EARLY:  # before the wait what the kernels before did not write: the lengths and the page table (from the
            # host before the step) and the split's first block but each request's newest token (stored just
            # before); the newest and q after it. int64 pages: a cache may be a view past 2**31 elements.
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < end
            page = tl.load(kv_indices + first_page + t // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
            k_at = k_head + (page * stride_kp + (t % PAGE_SIZE) * stride_kt)[:, None] + offs_d[None, :]
            v_at = v_head + (page * stride_vp + (t % PAGE_SIZE) * stride_vt)[:, None] + offs_d[None, :]
            old = t_ok & (t < kv_len - 1)
            k, v = tl.load(k_at, mask=old[:, None], other=0.0), tl.load(v_at, mask=old[:, None], other=0.0)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            k += tl.load(k_at, mask=(t_ok & ~old)[:, None], other=0.0)  # zeros where masked: the block, exactly
            v += tl.load(v_at, mask=(t_ok & ~old)[:, None], other=0.0)
        # Padded rows read as zeros: their logits are finite, so no NaN reaches the running max; they are not stored.
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if EARLY:
            if start < end:  # the first block, already loaded: the online softmax below from a max of -inf
                s = tl.where(t_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale,
                             float("-inf"))
                m = tl.reduce(s, 1, tl.standard._elementwise_max)
                p = tl.exp2(s - m[:, None])
                denom = tl.reduce(p, 1, tl.standard._sum_combine)
                acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        for n0 in range(start + EARLY * BLOCK_N, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            t_ok = t < end
            page = tl.load(kv_indices + first_page + t // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
            k = tl.load(k_head + (page * stride_kp + (t % PAGE_SIZE) * stride_kt)[:, None] + offs_d[None, :],
                        mask=t_ok[:, None], other=0.0)
            v = tl.load(v_head + (page * stride_vp + (t % PAGE_SIZE) * stride_vt)[:, None] + offs_d[None, :],
                        mask=t_ok[:, None], other=0.0)
            s = tl.where(t_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.reduce(s, 1, tl.standard._elementwise_max))  # finite: >= 1 token a block
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        # A split without tokens: denom 0 and acc 0 -> zeros (a padding row's output), lse = -inf.
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        if DIRECT:
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = part_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
            tl.store(part + offs_d[None, :], o, mask=row_ok[:, None])
            lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
            tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=row_ok)
    return split_kernel


def _merge_kernel(triton, tl):
    """Stage 2, one program per (request, query head); built by :func:`_kernel`."""

    @triton.jit
    def merge_kernel(part_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                     stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
                     PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_POW2)
        offs_d = tl.arange(0, HEAD_DIM)
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s < NUM_SPLITS, other=float("-inf"))
        filled = lse > float("-inf")
        # Splits without tokens (lse -inf) weigh nothing, and their partial outputs are not read.
        top = tl.reduce(lse, 0, tl.standard._elementwise_max)
        weight = tl.where(filled, tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        # Only the splits with tokens are read. Reading all of them beside the lse instead (no wait on it) was slower
        # on an H200: 4.5 against 3.3 us a layer at 1 x 544 tokens over 64 splits (docs/performance.md, eighteenth
        # session).
        part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + offs_d[None, :],
                       mask=filled[:, None], other=0.0)
        total = tl.reduce(weight, 0, tl.standard._sum_combine)
        o = tl.reduce(weight[:, None] * part, 0, tl.standard._sum_combine) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))

    return merge_kernel


def num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 32) -> int:
    """The split count for a batch: the smallest power of two ``s`` with ``batch_size * num_kv_heads * s >= 2 *
    num_sms`` (stage 1's programs fill every multiprocessor about twice), at least 1 and at most the largest power
    of two <= ``max_splits``. Depends on the batch shape only, so a CUDA graph per batch size can fix it.

    The cap: with stage 1's first block loaded before its PDL wait, the 3B preset's decode step at one request of
    544 tokens took 1.989 ms of GPU time over 32 splits against 2.053 over 64 and 2.040 over 16 (H200,
    docs/performance.md, eighteenth session).

    Raises:
        ValueError: an argument below 1.
    """
    if min(batch_size, num_kv_heads, num_sms, max_splits) < 1:
        raise ValueError(f"num_kv_splits needs positive arguments, got batch_size={batch_size} "
                         f"num_kv_heads={num_kv_heads} num_sms={num_sms} max_splits={max_splits}")
    want = -(-2 * num_sms // (batch_size * num_kv_heads))
    return min(1 << (want - 1).bit_length(), 1 << (max_splits.bit_length() - 1))


def _check(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits, out) -> None:
    """Raise ValueError on arguments :func:`decode_attention` cannot run on (see there)."""
    if q.dim() != 3 or k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"decode_attention needs q [B, HQ, D] and k/v caches of one shape [pages, page_size, HKV, "
                         f"D], got q {list(q.shape)}, k {list(k_cache.shape)}, v {list(v_cache.shape)}")
    B, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"decode_attention needs q, k_cache and v_cache of one dtype of {_DTYPES}, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if d < 16 or d & (d - 1) or k_cache.shape[3] != d:
        raise ValueError(f"decode_attention needs a power-of-two head_dim >= 16 shared by q and the caches, got q "
                         f"{d}, caches {k_cache.shape[3]}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"decode_attention needs the query heads ({hq}) a multiple of the KV heads ({hkv})")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"decode_attention needs a power-of-two page size, got {page_size}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"decode_attention needs head_dim contiguous, got strides q {q.stride()}, k "
                         f"{k_cache.stride()}, v {v_cache.stride()}")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_lens", kv_lens)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"decode_attention needs {name} a contiguous 1-D int32 tensor, got {t.dtype} "
                             f"{list(t.shape)}")
    if kv_indptr.numel() != B + 1 or kv_lens.numel() != B:
        raise ValueError(f"decode_attention needs kv_indptr [{B + 1}] and kv_lens [{B}] for {B} requests, got "
                         f"{list(kv_indptr.shape)} and {list(kv_lens.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens)}
    if len(devices) != 1:
        raise ValueError(f"decode_attention needs every tensor on q's device, got {sorted(map(str, devices))}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"decode_attention needs num_splits a positive int, got {num_splits!r}")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device
                            or out.stride(2) != 1):
        raise ValueError(f"decode_attention needs out {list(q.shape)} {q.dtype} on {q.device} with head_dim "
                         f"contiguous, got {list(out.shape)} {out.dtype} on {out.device} stride {out.stride()}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_lens: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None, early: bool = False) -> torch.Tensor:
    """Attention of one query token per request over its paged KV: ``softmax(scale * q k^T) v`` per query head,
    query head ``h`` reading KV head ``h // (HQ // HKV)``.

    Args:
        q: ``[B, HQ, D]`` bf16/fp16 (fp32 for the interpreter); ``stride(2) == 1``, rows and heads at any stride
            (a column slice of the fused qkv output is read in place).
        k_cache, v_cache: ``[num_pages, page_size, HKV, D]``, q's dtype, ``stride(3) == 1``, any other strides
            (views into one larger buffer are fine); ``page_size`` and ``D`` powers of two, ``D >= 16``.
        kv_indptr: int32 ``[B + 1]``; request b's pages are ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``.
        kv_indices: int32 1-D page ids; only the entries of the first ``ceil(kv_lens[b] / page_size)`` pages of
            each request are read.
        kv_lens: int32 ``[B]``: request b attends over its first ``kv_lens[b]`` tokens (token t at page
            ``kv_indices[kv_indptr[b] + t // page_size]``, slot ``t % page_size``); 0 gives a zero output row.
        scale: softmax scale applied to the logits (usually ``D ** -0.5``).
        num_splits: KV splits per request (:func:`num_kv_splits`), fixed per captured graph: the grid depends on B,
            the head counts and this only.
        out: optional ``[B, HQ, D]`` of q's dtype (``stride(2) == 1``), written in place.
        early: load each split's first KV block, but for each request's newest token, before the PDL wait: for a
            caller whose kernel just before launched its dependents early and wrote only q and the newest token's K
            and V (:mod:`~epdserve.models.decode_qkv`'s one-row layer front). The 3B preset's decode step at one
            request took 1.985 against 2.039 ms of GPU time with it (H200); after a kernel that does not launch
            early (RoPE alone, the 7B and 8B presets' front at one row) it only costs: 4.150 against 4.139 ms on the
            7B (docs/performance.md, eighteenth session).

    Returns:
        ``out``, or a new contiguous ``[B, HQ, D]`` tensor of q's dtype.

    Raises:
        ValueError: mismatched shapes or dtypes, HQ not a multiple of HKV, head_dim or page_size not a power of
            two (or head_dim < 16), non-int32 or non-1-D index tensors, tensors on different devices,
            ``num_splits < 1``, or an unfit ``out``.
    """
    _check(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        _launch(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, float(scale), num_splits, out, early=early)
    return out


def _launch(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, scale, num_splits, out, *,
            block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
            merge_warps: int = 4, early: bool = False) -> None:
    """Launch both stages on checked arguments. The tuning knobs: ``block_n`` (tokens per inner step, a power of
    two >= 16), ``num_warps`` and ``num_stages`` (stage 1's software pipelining depth), ``merge_warps``; ``early``
    as :func:`decode_attention`'s.

    Defaults, from one H200 (16/2 heads, head_dim 128, page 16, bf16, 8 layers' caches in turn in a CUDA graph, 1 to
    128 requests of 512 and 2048 tokens): 64-token steps 3 stages deep, but 32-token steps 2 deep from 16 splits up
    (up to 16 requests of 2 KV heads on 132 SMs), where a split holds few tokens and more, shorter splits finish
    sooner (5.1 against 6.1 us at 1 x 512). Both depend on the batch shape only, never on the lengths, so a captured
    graph stays valid."""
    B, hq, d = q.shape
    if block_n is None:
        # Past head_dim 128 (Qwen3.5's 256) the K and V tiles of a stage are capped at the 64 x 128 measured: three
        # stages of 64-token tiles at 256 would be 192 KB of the SM's 227 KB shared memory.
        block_n = min(32 if num_splits >= 16 else 64, max(16, 8192 // q.shape[2]))
    if num_stages is None:
        num_stages = 2 if block_n <= 32 else 3
    split_kernel, merge_kernel = _kernel()
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    head_rows = min(max(_MIN_HEAD_ROWS, 1 << (group - 1).bit_length()), _MAX_HEAD_ROWS)
    direct = num_splits == 1
    if direct:  # stage 1 writes `out`; the partial-output pointers are not used
        part, lse = out, out
        part_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        part = torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, hq, num_splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    # fp32 operands would otherwise go through tf32 on the GPU; bf16/fp16 take Triton's default.
    precision = "ieee" if q.dtype == torch.float32 else None
    grid = (B, hkv * math.ceil(group / head_rows), num_splits)
    pdl = supports_pdl(q.device)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        split_kernel[grid](
            q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, part, lse, out, scale * _LOG2E,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *part_strides, *lse_strides,
            out.stride(0), out.stride(1), GROUP=group, HEAD_ROWS=head_rows, HEAD_DIM=d, PAGE_SIZE=page_size,
            NUM_SPLITS=num_splits, BLOCK_N=block_n, DIRECT=direct, PRECISION=precision, EARLY=early, PDL=pdl,
            num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
        if not direct:
            merge_kernel[(B, hq)](part, lse, out, *part_strides, *lse_strides, out.stride(0), out.stride(1),
                                  HEAD_DIM=d, NUM_SPLITS=num_splits, SPLITS_POW2=1 << (num_splits - 1).bit_length(),
                                  PDL=pdl, num_warps=merge_warps, launch_pdl=pdl)
