"""The decode-GEMM bench's Triton candidate (benchmarks/decode_gemms.py: ``x @ w.T`` for a skinny ``x``, one program
per column block over the whole K) against a float32 matmul, on the CPU through Triton's interpreter: ragged M, N
and K (masks at every edge), M of one and above one tile."""

from __future__ import annotations

import pytest
import torch

from epdserve.bench import decode_gemms as mod



@pytest.mark.parametrize("M,N,K,block_n,block_k", [(1, 40, 96, 16, 32), (5, 33, 70, 16, 32), (17, 64, 200, 32, 64)])
def test_skinny_gemm_equals_a_float32_matmul(interpreter, M, N, K, block_n, block_k):
    g = torch.Generator().manual_seed(M * N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    got = mod.skinny_gemm(x, w, block_n, block_k)
    want = x.double() @ w.double().T
    err = float((got.double() - want).abs().max())
    print(f"M={M} N={N} K={K} block {block_n}x{block_k}: max |error| {err:.2e}")
    assert got.shape == (M, N) and err < 1e-3 * float(want.abs().max())


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="skinny_gemm needs"):
        mod.skinny_gemm(torch.zeros(129, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="skinny_gemm needs"):
        mod.skinny_gemm(torch.zeros(2, 8), torch.zeros(4, 9))
