"""epdserve.kvcache.page_table.paged_kv_csr against the layout written out one request at a time."""

from __future__ import annotations

import random

import pytest
import torch

from epdserve.kvcache.page_table import paged_kv_csr


def _reference(page_table, kv_lens, page_size):
    indices, counts, last = [], [], []
    for pages, L in zip(page_table, kv_lens):
        n = -(-L // page_size)
        indices.extend(pages[:n])
        counts.append(n)
        last.append(L - (n - 1) * page_size)
    indptr = [0]
    for n in counts:
        indptr.append(indptr[-1] + n)
    return indptr, indices, last


@pytest.mark.parametrize("batch", [1, 7, 128])
def test_the_layout_equals_the_one_built_request_by_request(batch):
    rng = random.Random(batch)
    page_size = 16
    kv_lens = [rng.choice([0, 1, 15, 16, 17, rng.randrange(1, 3000)]) for _ in range(batch)]
    # tables with spare pages past the KV (a request's reserved pages): they must be left out
    table = [[rng.randrange(50_000) for _ in range(-(-L // page_size) + rng.randrange(3))] for L in kv_lens]
    indptr, indices, last = paged_kv_csr(table, kv_lens, page_size)
    want = _reference(table, kv_lens, page_size)
    for got, ref in zip((indptr, indices, last), want):
        assert got.dtype == torch.int32 and got.device.type == "cpu"
        assert got.tolist() == ref
    assert indptr.shape == (batch + 1,) and last.shape == (batch,) and indices.shape == (int(indptr[-1]),)


def test_an_empty_batch_and_a_short_table():
    indptr, indices, last = paged_kv_csr([], [], 16)
    assert indptr.tolist() == [0] and indices.numel() == 0 and last.numel() == 0
    with pytest.raises(ValueError, match="kv_len 33 needs 3 pages of 16, page table has 2"):
        paged_kv_csr([[1, 2]], [33], 16)
