"""A batch's page tables in the CSR layout paged-attention kernels read (flashinfer's ``paged_kv_indptr``,
``paged_kv_indices`` and ``paged_kv_last_page_len``; the Triton decode kernel reads the first two).

Built with numpy rather than a Python list fed to ``torch.tensor``: at a decode batch of 128 requests of 560
tokens (35 pages each) the list-based layout took 407 µs of host time per step against 169 µs this way (medians,
interleaved, on the 2-core CPU machine). At that batch a decode step's host work is what keeps it from overlapping
the GPU (docs/performance.md, "2026-11-29, eleventh session").
"""

from __future__ import annotations

import itertools

import numpy as np
import torch


def paged_kv_csr(page_table: list[list[int]], kv_lens: list[int], page_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages holding each request's KV, concatenated.

    Args:
        page_table: per request, its pages in order (at least ``ceil(kv_len / page_size)``; more are ignored).
        kv_lens: per request, its KV length in tokens.
        page_size: tokens per page.

    Returns:
        ``(kv_indptr, kv_indices, last_page_len)``, int32 CPU tensors: ``kv_indptr`` ``[B + 1]`` (request b's pages
        are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``), ``kv_indices`` ``[sum of pages]``, ``last_page_len``
        ``[B]`` (tokens in each request's last page: ``kv_len - (pages - 1) * page_size``).

    Raises:
        ValueError: a page table shorter than ``ceil(kv_len / page_size)``.
    """
    counts = [-(-L // page_size) for L in kv_lens]
    for pages, n, L in zip(page_table, counts, kv_lens):
        if len(pages) < n:
            raise ValueError(f"kv_len {L} needs {n} pages of {page_size}, page table has {len(pages)}")
    total = sum(counts)
    indices = np.fromiter(itertools.chain.from_iterable(p[:n] for p, n in zip(page_table, counts)), dtype=np.int32,
                          count=total)
    indptr = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    last = np.asarray(kv_lens, dtype=np.int32) - (np.asarray(counts, dtype=np.int32) - 1) * page_size
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)
