"""Paged attention with flashinfer 0.6 kernels (CUDA only; this module is imported only for CUDA devices).

API: flashinfer ``BatchPrefillWithPagedKVCacheWrapper`` / ``BatchDecodeWithPagedKVCacheWrapper``
(docs.flashinfer.ai/api/prefill.html, /api/decode.html): ``plan`` once per batch with the CSR page table
(``kv_indptr`` [B+1], ``kv_indices``, ``kv_last_page_len`` [B]), then ``run(q, (k_cache, v_cache))`` per layer.
flashinfer's causal mask in append mode is bottom-right aligned, which is the prefix-cache semantics we need.

CUDA graphs: a decode wrapper in CUDA-graph mode has a fixed batch size and plans into fixed index buffers, so
:meth:`FlashInferBackend.enable_cuda_graphs` makes one per captured batch size over shared buffers; ``plan`` runs
on the host before each replay and the captured kernels read what it wrote (as SGLang's and mini-sglang's
flashinfer backends do). Prefill graphs (:meth:`FlashInferBackend.enable_prefill_cuda_graphs`) are one
one-request prefill wrapper per captured token count: in CUDA-graph mode flashinfer sizes its work split for the
row count of the first plan (the capture's) and any later plan may have fewer rows (flashinfer's
``PrefillSplitQOKVIndptr``: "the dummy data based on which the CUDA graph is created fixes the maximum number of
tokens"); the padding rows past ``qo_indptr[-1]`` are not computed.
"""

from __future__ import annotations

import flashinfer
import torch

from epdserve.attention import triton_decode_plan
from epdserve.attention.base import AttentionBackend, KVWrite
from epdserve.attention.flashinfer_kernels import KernelBuild, tensor_core_decode
from epdserve.attention.flashinfer_workspace import graph_prefill_workspace_bytes
from epdserve.device import to_device
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool
from epdserve.kvcache.page_table import paged_kv_csr

_WORKSPACE_BYTES = 256 * 1024 * 1024


def decode_kernel_kwargs(num_qo_heads: int, num_kv_heads: int) -> dict:
    """``BatchDecodeWithPagedKVCacheWrapper`` arguments choosing its kernel for a head layout: the tensor-core
    kernel on flashinfer's FA2 backend from 4 query heads per KV head up (SGLang's threshold), else the
    CUDA-core decode kernel."""
    if tensor_core_decode(num_qo_heads, num_kv_heads):
        return {"use_tensor_cores": True, "backend": "fa2"}
    return {}


class FlashInferBackend(AttentionBackend):
    """flashinfer paged prefill (extend batches, causal) and decode (decode batches) over the NHD KV pool.

    Decode runs flashinfer's tensor-core decode (its prefill kernel with one query row per request) on the FA2
    backend when at least 4 query heads share a KV head, as SGLang's flashinfer backend does
    (``should_use_tensor_core``), and the CUDA-core decode kernel otherwise. H100, 16 query / 2 KV heads, 128
    requests at 400 tokens of context: 26.5 us per layer against 52.7 (CUDA-core) and 145 (the tensor-core
    kernel's "auto" backend, FA3 on Hopper, which is built for long query tiles); 7.9 vs 12.1 us at 1 request
    (docs/performance.md, ninth session). With ``decode_kernel="triton"`` (the servers' default up to head_dim
    128) decode batches run :mod:`epdserve.attention.triton_decode` instead: 5.3-5.6 / 11.8 / 25-26 us per layer at
    1 / 32 / 128 requests x 512 tokens on an H200 against flashinfer's 7.4 / 14.7 / 28.3 (benchmarks/results/
    h200-2026-11-29-decode-s9). Either way :meth:`kv_write` lets the model's RoPE kernel store the new K and V.
    """

    uses_flashinfer = True

    def __init__(self, kv_pool: KVPool, num_qo_heads: int, kernels: KernelBuild | None = None,
                 decode_kernel: str = "flashinfer"):
        """Allocate the shared float workspace and both wrappers on the pool's CUDA device.

        ``kernels``: the runner's flashinfer module build; its ``prefill_backend`` is the prefill wrappers' backend
        (FA2 on a machine where FA3 is not built yet), and once its ``fa3_ready`` is set eager prefills move to
        FA3. None: flashinfer's "auto" choice (FA3 on Hopper), built on first use. ``decode_kernel``
        (:func:`~epdserve.attention.triton_decode_plan.decode_kernel`): ``"flashinfer"`` (its decode wrappers),
        ``"triton"`` (:class:`~epdserve.attention.triton_decode_plan.TritonDecode`) or ``"auto"``, for decode
        batches.

        Raises:
            ValueError: the pool is not on CUDA, the head counts are not GQA-compatible, or an unknown
                ``decode_kernel``.
        """
        super().__init__(kv_pool, num_qo_heads)
        if kv_pool.device.type != "cuda":
            raise ValueError("FlashInferBackend needs a CUDA KV pool")
        self._triton = None
        if triton_decode_plan.decode_kernel(decode_kernel, kv_pool.head_dim) == "triton":
            self._triton = triton_decode_plan.TritonDecode(kv_pool, self.scale)
        # Prefill and decode never run at the same time, so they can share one float workspace.
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self.kernels = kernels
        self._prefill_backend = "auto" if kernels is None else kernels.prefill_backend
        self._fa3_ready = None if kernels is None else kernels.fa3_ready
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                       backend=self._prefill_backend)
        self._retired: list = []  # wrappers replaced while serving: their last plan's copy may still be queued
        self._decode_kwargs = decode_kernel_kwargs(num_qo_heads, kv_pool.num_kv_heads)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                     **self._decode_kwargs)
        self._graph_decode: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_prefill: dict[int, flashinfer.BatchPrefillWithPagedKVCacheWrapper] = {}
        self._wrapper = None
        self._out_slots: torch.Tensor | None = None
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> recorded after its last plan

    def enable_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """Create a CUDA-graph-mode decode wrapper for each batch size, over index buffers shared by all of them
        (room for every page of the pool plus one padding page per row)."""
        dev, max_bs = self.kv_pool.device, max(batch_sizes)
        if self._triton is not None:
            self._triton.enable_cuda_graphs(max_bs)
            return
        indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        indices = torch.zeros(self.kv_pool.num_pages + max_bs, dtype=torch.int32, device=dev)
        last = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        for bs in batch_sizes:
            self._graph_decode[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr[:bs + 1],
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last[:bs], **self._decode_kwargs)

    def enable_prefill_cuda_graphs(self, token_counts: list[int]) -> None:
        """Create a CUDA-graph-mode prefill wrapper for one request of each of ``token_counts`` new tokens (at
        most), over index buffers shared by all of them."""
        dev = self.kv_pool.device
        qo_indptr = torch.zeros(2, dtype=torch.int32, device=dev)
        kv_indptr = torch.zeros(2, dtype=torch.int32, device=dev)
        indices = torch.zeros(self.kv_pool.num_pages + 1, dtype=torch.int32, device=dev)
        last = torch.zeros(1, dtype=torch.int32, device=dev)
        need = graph_prefill_workspace_bytes(self.num_qo_heads, self.kv_pool.num_kv_heads, self.kv_pool.head_dim,
                                             max(token_counts, default=0),
                                             torch.cuda.get_device_properties(dev).multi_processor_count)
        # Graph prefills never run beside the other wrappers either: one larger workspace of their own if needed.
        workspace = self._workspace if need <= self._workspace.numel() else torch.empty(need, dtype=torch.uint8,
                                                                                        device=dev)
        for n in token_counts:
            self._graph_prefill[n] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout="NHD", backend=self._prefill_backend, use_cuda_graph=True,
                qo_indptr_buf=qo_indptr,
                paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last)

    def _wait_previous_plan(self, wrapper) -> None:
        # plan() writes its schedule into the wrapper's one pinned host buffer and queues an async copy of it to
        # the device. The overlap scheduler plans step N+1 while step N may still wait in the stream (behind KV
        # copies, or while another process holds the GPU): overwriting the buffer before N's copy ran would hand
        # N's kernels N+1's schedule. So wait for that copy first (almost always done).
        if (planned := self._planned.get(id(wrapper))) is not None:
            planned.synchronize()

    def _planned_now(self, wrapper) -> None:
        planned = self._planned[id(wrapper)] = torch.cuda.Event()
        planned.record(torch.cuda.current_stream(self.kv_pool.device))

    def prepare(self, batch: ForwardBatch, *, cuda_graph: bool = False) -> None:
        """Plan the prefill or decode wrapper for ``batch``. ``cuda_graph``: the graph-mode wrapper of the batch's
        padded shape, for decode of exactly ``batch.batch_size`` requests, for prefill (one request) of exactly
        ``batch.input_ids.shape[0]`` token rows, which may exceed ``q_lens[0]`` (padding rows). Makes no blocking
        host-device copy on the decode path.

        Raises:
            ValueError: a page table shorter than ``ceil(kv_len / page_size)``.
            KeyError: ``cuda_graph`` for a shape with no graph wrapper.
        """
        ps, dev = self.kv_pool.page_size, self.kv_pool.device
        kv_indptr, kv_indices, last_len = paged_kv_csr(batch.page_table, batch.kv_lens, ps)
        pool, dtype = self.kv_pool, self.kv_pool.dtype
        if batch.is_decode and self._triton is not None:  # no plan: the page table and lengths are all it reads
            wrapper = self._triton
            wrapper.prepare(kv_indptr, kv_indices, list(batch.kv_lens), cuda_graph)
        elif batch.is_decode:
            wrapper = self._graph_decode[batch.batch_size] if cuda_graph else self._decode
            self._wait_previous_plan(wrapper)
            wrapper.plan(kv_indptr.pin_memory(), to_device(kv_indices, dev), last_len.pin_memory(), self.num_qo_heads,
                         pool.num_kv_heads, pool.head_dim, ps, q_data_type=dtype, kv_data_type=dtype,
                         sm_scale=self.scale, non_blocking=True)
            self._planned_now(wrapper)
        else:
            if not cuda_graph and self._fa3_ready is not None and self._fa3_ready.is_set():
                self._use_fa3_prefill()
            wrapper = self._graph_prefill[int(batch.input_ids.shape[0])] if cuda_graph else self._prefill
            self._wait_previous_plan(wrapper)
            qo_indptr = torch.tensor([0] + list(batch.q_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
            wrapper.plan(qo_indptr, kv_indptr, to_device(kv_indices, dev), last_len, self.num_qo_heads,
                         pool.num_kv_heads, pool.head_dim, ps, causal=True, q_data_type=dtype, kv_data_type=dtype,
                         sm_scale=self.scale)
            self._planned_now(wrapper)
        self._wrapper = wrapper
        self._out_slots = batch.out_slots.to(dev)

    def _use_fa3_prefill(self) -> None:
        """Eager prefills from now on on the FA3 module the runner's background build loaded."""
        self._retired.append(self._prefill)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                       backend="fa3")
        self._prefill_backend, self._fa3_ready = "fa3", None

    def kv_write(self, layer_id: int, dtype: torch.dtype) -> KVWrite | None:
        """See :meth:`AttentionBackend.kv_write`: this layer's slot views and the prepared batch's slots."""
        if self._out_slots is None or dtype != self.kv_pool.dtype:
            return None
        k_slots, v_slots = self.kv_pool.slot_view(layer_id)
        return KVWrite(k_slots, v_slots, self._out_slots)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_written: bool = False, early_kv: bool = False) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. Raises RuntimeError when :meth:`prepare` was not called."""
        if self._wrapper is None:
            raise RuntimeError("FlashInferBackend.forward before prepare")
        if not kv_written:
            self.kv_pool.write(layer_id, self._out_slots, k, v)
        # q stays the strided view of the qkv projection's output: flashinfer's prefill, tensor-core decode and
        # decode kernels take its row and head strides (csrc batch_prefill.cu, batch_decode.cu: q.stride(0/1)), so
        # a contiguous copy would be one more kernel per layer (2.4 us each at batch 32 and 128 on an H200); so
        # does the Triton decode kernel.
        if self._wrapper is self._triton:
            return self._triton.run(layer_id, q.to(self.kv_pool.dtype), early_kv and kv_written)
        kv = (self.kv_pool.k_cache(layer_id), self.kv_pool.v_cache(layer_id))
        return self._wrapper.run(q.to(self.kv_pool.dtype), kv)
