"""The split-K GEMM of decode batches (Triton, epdserve.models.parts_gemm) on the CPU through Triton's interpreter:
each part the product over its own K slice, their sum ``x @ w.T`` within float32's summation bound (2 to 33 rows, one
part and several, K tails not a multiple of block_k, N not a multiple of block_n, row strides); bf16 inputs, whose
products float32 holds exactly, then the sum rounded to bf16 as the norm after it rounds it; the o projection's real
shape; the configs and the errors. On CUDA (the GPU suite) bf16 at the 3B preset's o and down shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.models import parts_gemm as mod
from epdserve.models.parts_gemm import Config

U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of float32 and bf16 (24 and 8 significant bits)


def _case(M: int, N: int, K: int, dtype: torch.dtype, seed: int, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + pad, generator=g).to(dtype)[:, :K]
    w = (torch.randn(N, K + pad, generator=g) * K ** -0.5).to(dtype)[:, :K]
    return x, w


def _bound(x: torch.Tensor, w: torch.Tensor, S: int) -> torch.Tensor:
    """float32's summation bound (gamma_n): each product exact or rounded once, then at most K + S additions (within
    the slices, in any order, and the S parts) each off by 2^-24 of a partial sum, itself at most sum_k |x_k w_k|."""
    n = x.shape[1] + S + 1
    return n * U32 / (1 - n * U32) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("M,N,K,cfg,pad", [
    (2, 40, 300, Config(16, 16, 32, 128, 4, 2, prefetch=2), 0),  # S = 3, last slice 44 (32 + 12), N tail 8
    (5, 33, 200, Config(16, 16, 64, 64, 4, 2), 3),  # S = 4, the last slice 8 wide; strided rows
    (16, 24, 100, Config(16, 16, 16, 128, 4, 3, prefetch=4), 0),  # S = 1, K < k_split: the loop's tiles masked
    (33, 70, 130, None, 5),  # config_for: a 64-row tile, S = 2 (K tail 2), N tail 6
])
def test_parts_sum_to_the_product(interpreter, M, N, K, cfg, pad):
    x, w = _case(M, N, K, torch.float32, seed=M * N + K, pad=pad)
    cfg = cfg or mod.config_for(M, N, K)
    parts = mod.gemm_parts(x, w, cfg)
    S = -(-K // cfg.k_split)
    assert parts.shape == (S, M, N) and parts.dtype == torch.float32 and parts.is_contiguous()
    for s in range(S):  # each part is its own slice's product: a wrong slice or a lost tile is off by O(1e-2)
        sl = slice(s * cfg.k_split, (s + 1) * cfg.k_split)
        bound = _bound(x[:, sl], w[:, sl], 1)
        assert bool(((parts[s].double() - x[:, sl].double() @ w[:, sl].double().T).abs() <= bound).all())
    want = x.double() @ w.double().T
    bound = _bound(x, w, S)
    assert bool(((parts.double().sum(0) - want).abs() <= bound).all())
    # the bound tells a wrong kernel apart: one term of K missing moves a column by ~|x_k w_k| ~ 0.6 / sqrt(K) > 3e-2
    assert float(bound.max()) < 1e-3


@pytest.mark.parametrize("M,N,K,cfg", [(5, 40, 300, Config(16, 16, 32, 128, 4, 2, prefetch=2)),
                                       (2, 2048, 2048, None)])  # the 3B preset's o projection, config_for's pick
def test_bf16_parts_round_like_the_float32_product(interpreter, M, N, K, cfg):
    """bf16 inputs: their products are exact in float32 (8 + 8 significant bits), so the parts' float32 sum is off
    the float64 product of the same bf16 values by float32's summation bound alone; rounded to bf16 (as the norm
    after it rounds it), by half a bf16 ulp of the value more."""
    x, w = _case(M, N, K, torch.bfloat16, seed=K + M)
    cfg = cfg or mod.config_for(M, N, K)
    parts = mod.gemm_parts(x, w, cfg)
    assert parts.shape == (cfg.parts(K), M, N)
    got, want, bound = parts.sum(0).double(), x.double() @ w.double().T, _bound(x, w, cfg.parts(K))
    assert bool(((got - want).abs() <= bound).all())
    rounded = parts.sum(0).to(torch.bfloat16).double()
    assert bool(((rounded - want).abs() <= U16 * (want.abs() + bound) + bound).all())


def test_configs_are_valid_at_every_decode_batch():
    for m in (1, 2, 3, 16, 17, 33, 64, 100, 128):
        for k in (64, 2048, 11008, 18944):
            cfg = mod.config_for(m, 2048, k)
            mod._check_config(cfg, m)
            assert cfg.block_m == mod.rows_tile(m) and cfg.parts(k) <= 8
        for cfg in mod.CONFIGS:
            mod._check_config(cfg.with_rows(m), m)
    assert len({c.name for c in mod.CONFIGS}) == len(mod.CONFIGS)
    assert Config(16, 32, 128, 512, 4, 3, prefetch=4).name == "16/32/128/512/4/3/p4"
    assert Config(16, 32, 128, 512, 4, 3).with_rows(33).name == "64/32/128/512/4/3"
    assert mod.config_for(32, 2048, 11008).parts(11008) == 8  # the down projection in 8 parts of 1408
    assert mod.config_for(64, 2048, 11008).parts(11008) == 4  # ... and at 33-64 rows in 4 of 2816
    for m in (0, mod.MAX_M + 1):
        with pytest.raises(ValueError, match="rows"):
            mod.config_for(m, 2048, 2048)


def test_covers_the_measured_widths_only():
    """The 3B's o (2048 x 2048) at 2-128 rows and down (2048 x 11008) at 2-64; not one row (decode_gemv's GEMV),
    the down projection at 128 rows (cuBLAS was faster), the 7B's wider layers (slower at 8 and 32 rows) or a K
    between 2048 and 4096 (the 30B-A3B's o, not measured)."""
    assert all(mod.covers(m, 2048, 2048) for m in (2, 5, 32, 64, 128))
    assert all(mod.covers(m, 2048, 11008) for m in (2, 33, 64))
    assert not any(mod.covers(m, n, k) for m, n, k in [(1, 2048, 2048), (1, 2048, 11008), (129, 2048, 2048),
                                                       (65, 2048, 11008), (128, 2048, 11008), (8, 3584, 3584),
                                                       (8, 3584, 18944), (32, 2048, 4096), (8, 4096, 12288)])


def test_errors_and_fits(interpreter):
    x, w = _case(4, 16, 32, torch.float32, seed=1)
    for bad_x, bad_w, match in [
        (x[:0], w, "1 to 128 rows"), (torch.zeros(129, 32), w, "1 to 128 rows"), (x, w[:, :31], "x \\[M, K\\]"),
        (x[0], w, "x \\[M, K\\]"), (x, w.double(), "one dtype"), (x.double(), w.double(), "one dtype"),
        (x, torch.zeros(16, 64)[:, ::2], "contiguous"),
    ]:
        with pytest.raises(ValueError, match=match):
            mod.gemm_parts(bad_x, bad_w)
    for cfg, match in [
        (Config(16, 16, 32, 64, 4, 2), None), ((16, 16, 32, 64, 4, 2), "Config"),
        (Config(8, 16, 32, 64, 4, 2), "block_m"), (Config(256, 16, 32, 64, 4, 2), "block_m"),
        (Config(16, 24, 32, 64, 4, 2), "block_n"), (Config(16, 16, 8, 64, 4, 2), "block_k"),
        (Config(16, 16, 32, 48, 4, 2), "k_split"), (Config(16, 16, 32, 64, 4, 2, prefetch=4), "prefetch"),
        (Config(16, 16, 32, 96, 4, 2, prefetch=3), "prefetch"), (Config(16, 16, 32, 64, 3, 2), "num_warps"),
        (Config(16, 16, 32, 64, 4, 0), "num_stages"),
    ]:
        if match is None:
            assert mod.gemm_parts(x, w, cfg).shape == (1, 4, 16)
        else:
            with pytest.raises(ValueError, match=match):
                mod.gemm_parts(x, w, cfg)
    with pytest.raises(ValueError, match="block_m"):
        mod.gemm_parts(torch.zeros(17, 32), w, Config(16, 16, 32, 64, 4, 2))  # 17 rows in a 16-row tile
    assert torch.equal(mod.gemm_parts(x[:, :0], w[:, :0]), torch.zeros(1, 4, 16))  # K = 0: one part of zeros
    assert not mod.fits(x, w)  # the CPU: the callers keep their own path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 tensor-core tl.dot)")
@pytest.mark.parametrize("M", [2, 32, 128])
@pytest.mark.parametrize("N,K", [(2048, 2048), (2048, 11008)])
def test_bf16_on_cuda_equals_the_float32_product(M, N, K):
    x, w = (t.cuda() for t in _case(M, N, K, torch.bfloat16, seed=M))
    assert mod.fits(x, w) == mod.covers(M, N, K)
    parts = mod.gemm_parts(x, w)
    want, bound = x.double() @ w.double().T, _bound(x, w, parts.shape[0])
    assert bool(((parts.sum(0).double() - want).abs() <= bound).all())
    # cuBLAS's output, rounded once from its own float32 sum: each within half a bf16 ulp of a float32 sum itself
    # within the bound of the product
    cublas = F.linear(x, w).double()
    rounded = parts.sum(0).to(torch.bfloat16).double()
    assert bool(((rounded - cublas).abs() <= 2 * U16 * (want.abs() + bound) + 2 * bound).all())
