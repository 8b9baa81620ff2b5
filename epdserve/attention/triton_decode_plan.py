"""Decode batches of the flashinfer backend on the Triton split-KV kernel (:mod:`epdserve.attention.triton_decode`):
what the kernel needs per step, laid out once in :meth:`TritonDecode.prepare` and read by every layer.

flashinfer's decode wrappers plan each step on the host (a schedule copied to the device) and run an attention
kernel and a merge kernel per layer. The Triton kernel needs only the page table in flashinfer's CSR form
(``kv_indptr``, ``kv_indices``) and each request's KV length, all on the device, and a split count fixed per batch
size, so one captured graph serves every context length; it reads the q heads at the fused qkv projection's strides.
SGLang's ``--decode-attention-backend triton`` is the same choice.
"""

from __future__ import annotations

import torch

from epdserve.attention.triton_decode import decode_attention, num_kv_splits
from epdserve.device import to_device
from epdserve.kvcache.kv_pool import KVPool


def decode_kernel(name: str, head_dim: int) -> str:
    """The flashinfer backend's decode kernel ``name`` resolves to for ``head_dim``: ``"triton"`` or
    ``"flashinfer"`` as given; ``"auto"`` is Triton up to head_dim 128, where it measured faster at 1 to 128
    requests (docs/performance.md, "2026-11-29, ninth session"), flashinfer above (Qwen3.5's 256, not measured).

    Raises:
        ValueError: an unknown name.
    """
    if name not in ("auto", "flashinfer", "triton"):
        raise ValueError(f"unknown decode attention backend {name!r}; expected 'auto', 'flashinfer' or 'triton'")
    if name == "auto":
        return "triton" if head_dim <= 128 else "flashinfer"
    return name


class TritonDecode:
    """Per-step index tensors of a decode batch and the per-layer call of the Triton decode kernel.

    Args:
        kv_pool: the CUDA KV pool (NHD pages).
        scale: softmax scale (``head_dim ** -0.5``).
    """

    def __init__(self, kv_pool: KVPool, scale: float):
        self.kv_pool, self.scale = kv_pool, scale
        self.num_sms = torch.cuda.get_device_properties(kv_pool.device).multi_processor_count
        self._static: tuple[torch.Tensor, int] | None = None  # enable_cuda_graphs
        self._plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def enable_cuda_graphs(self, max_bs: int) -> None:
        """Static index buffers for graphs of up to ``max_bs`` requests, in one int32 device buffer so that a step's
        indices go over in one copy: ``kv_indptr`` at 0 (``max_bs + 1``), the KV lengths at ``max_bs + 1``
        (``max_bs``), ``kv_indices`` from ``2 * max_bs + 1`` (room for every page of the pool plus one padding page
        per row); :meth:`prepare` with ``cuda_graph`` fills them."""
        size = 2 * max_bs + 1 + self.kv_pool.num_pages + max_bs
        self._static = (torch.zeros(size, dtype=torch.int32, device=self.kv_pool.device), max_bs)

    def prepare(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: list[int], cuda_graph: bool) -> None:
        """Lay out a decode batch: ``kv_indptr`` int32 ``[B + 1]`` and ``kv_indices`` int32 on the host, ``kv_lens``
        the B KV lengths. ``cuda_graph``: into the static buffer, as one pinned host buffer and one stream-ordered
        copy (no host sync; a step's host work at one request on two H200s spent 10 % of its time in this layout's
        four separate copies, docs/performance.md, fifteenth session), else into fresh device tensors.

        Raises:
            RuntimeError: ``cuda_graph`` before :meth:`enable_cuda_graphs`.
        """
        dev, bs = self.kv_pool.device, len(kv_lens)
        if not cuda_graph:
            plan = (to_device(kv_indptr, dev), to_device(kv_indices, dev),
                    to_device(torch.tensor(kv_lens, dtype=torch.int32), dev))
        elif self._static is None:
            raise RuntimeError("TritonDecode.prepare(cuda_graph=True) before enable_cuda_graphs")
        else:
            packed, max_bs = self._static
            lens_at, indices_at = max_bs + 1, 2 * max_bs + 1
            host = torch.empty(indices_at + kv_indices.numel(), dtype=torch.int32, pin_memory=dev.type == "cuda")
            h = host.numpy()  # numpy slices: no torch op per field
            h[:bs + 1] = kv_indptr.numpy()
            h[lens_at:lens_at + bs] = kv_lens
            h[indices_at:] = kv_indices.numpy()
            packed[:host.numel()].copy_(host, non_blocking=True)
            plan = (packed[:bs + 1], packed[indices_at:], packed[lens_at:lens_at + bs])
        self._plan = (*plan, num_kv_splits(bs, self.kv_pool.num_kv_heads, self.num_sms))

    def run(self, layer_id: int, q: torch.Tensor, early: bool = False) -> torch.Tensor:
        """Attention of ``q`` ``[B, Hq, D]`` (any row and head strides) over layer ``layer_id``'s KV -> ``[B, Hq, D]``
        (``early``: :func:`~epdserve.attention.triton_decode.decode_attention`'s).

        Raises:
            RuntimeError: before :meth:`prepare`.
        """
        if self._plan is None:
            raise RuntimeError("TritonDecode.run before prepare")
        indptr, indices, lens, splits = self._plan
        return decode_attention(q, self.kv_pool.k_cache(layer_id), self.kv_pool.v_cache(layer_id), indptr, indices,
                                lens, self.scale, splits, early=early)
