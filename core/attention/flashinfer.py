"""Paged attention with flashinfer 0.6 kernels (CUDA only; this module is imported only for CUDA devices).

API: flashinfer ``BatchPrefillWithPagedKVCacheWrapper`` / ``BatchDecodeWithPagedKVCacheWrapper``
(docs.flashinfer.ai/api/prefill.html, /api/decode.html): ``plan`` once per batch with the CSR page table
(``kv_indptr`` [B+1], ``kv_indices``, ``kv_last_page_len`` [B]), then ``run(q, (k_cache, v_cache))`` per layer.
flashinfer's causal mask in append mode is bottom-right aligned, which is the prefix-cache semantics we need.
"""

from __future__ import annotations

import flashinfer
import torch

from epdserve.attention.base import AttentionBackend
from epdserve.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool

_WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    """flashinfer paged prefill (extend batches, causal) and decode (decode batches) over the NHD KV pool."""

    def __init__(self, kv_pool: KVPool, num_qo_heads: int):
        """Allocate the shared float workspace and both wrappers on the pool's CUDA device.

        Raises:
            ValueError: the pool is not on CUDA, or the head counts are not GQA-compatible.
        """
        super().__init__(kv_pool, num_qo_heads)
        if kv_pool.device.type != "cuda":
            raise ValueError("FlashInferBackend needs a CUDA KV pool")
        # Prefill and decode never run at the same time, so they can share one float workspace.
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        # Tensor-core decode is faster once several query heads share a KV head.
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_tensor_cores=num_qo_heads // kv_pool.num_kv_heads >= 4)
        self._wrapper = None
        self._out_slots: torch.Tensor | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        """Plan the prefill or decode wrapper for ``batch``.

        Raises:
            ValueError: a page table shorter than ``ceil(kv_len / page_size)``.
        """
        ps, dev = self.kv_pool.page_size, self.kv_pool.device
        indices, counts, last = [], [], []
        for pages, L in zip(batch.page_table, batch.kv_lens):
            n = -(-L // ps)
            if len(pages) < n:
                raise ValueError(f"kv_len {L} needs {n} pages of {ps}, page table has {len(pages)}")
            indices.extend(pages[:n])
            counts.append(n)
            last.append(L - (n - 1) * ps)
        kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indices = torch.tensor(indices, dtype=torch.int32).to(dev, non_blocking=True)
        last_len = torch.tensor(last, dtype=torch.int32)
        pool, dtype = self.kv_pool, self.kv_pool.dtype
        if batch.is_decode:
            self._decode.plan(kv_indptr, kv_indices, last_len, self.num_qo_heads, pool.num_kv_heads,
                              pool.head_dim, ps, q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
            self._wrapper = self._decode
        else:
            qo_indptr = torch.tensor([0] + list(batch.q_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self._prefill.plan(qo_indptr, kv_indptr, kv_indices, last_len, self.num_qo_heads, pool.num_kv_heads,
                               pool.head_dim, ps, causal=True, q_data_type=dtype, kv_data_type=dtype,
                               sm_scale=self.scale)
            self._wrapper = self._prefill
        self._out_slots = batch.out_slots.to(dev)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. Raises RuntimeError when :meth:`prepare` was not called."""
        if self._wrapper is None:
            raise RuntimeError("FlashInferBackend.forward before prepare")
        self.kv_pool.write(layer_id, self._out_slots, k, v)
        kv = (self.kv_pool.k_cache(layer_id), self.kv_pool.v_cache(layer_id))
        return self._wrapper.run(q.to(self.kv_pool.dtype).contiguous(), kv)
