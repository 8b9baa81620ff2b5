"""The decode GEMV with the add + RMSNorm folded in (Triton, epdserve.models.decode_gemv): on the CPU through Triton's
interpreter in float32 against a float64 reference with a bound from float32's rounding (ragged N and K, 1-4 rows,
bias, row strides), the new residual exactly ``x + residual``; in bf16 the norm's rounding as flashinfer's; the
errors and the fallback of :func:`linear`. On CUDA the decode path runs it inside the GPU suite's greedy parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.models import decode_gemv as mod

U32 = 2.0**-24


def _case(M: int, N: int, K: int, dtype: torch.dtype, seed: int, stride_pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + stride_pad, generator=g).to(dtype)[:, :K]
    r = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K + stride_pad, generator=g) * K ** -0.5).to(dtype)[:, :K]
    bias = torch.randn(N, generator=g).to(dtype)
    gamma = (1 + 0.5 * torch.randn(K, generator=g)).to(dtype)
    return x, r, w, bias, gamma


def _normed64(x, r, gamma, eps):
    s = x.double() + (0 if r is None else r.double())
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()


@pytest.mark.parametrize("M,N,K,bias,pad", [(1, 40, 100, True, 0), (3, 17, 64, False, 3), (4, 70, 130, True, 5),
                                            (2, 8, 7, False, 0)])
def test_gemv_equals_a_float64_reference(interpreter, M, N, K, bias, pad):
    x, _, w, b, _ = _case(M, N, K, torch.float32, seed=M * N + K, stride_pad=pad)
    b = b if bias else None
    got = mod.gemv(x, w, b, block_n=8).double()
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    # each product rounded once, then K additions (and the bias) in some order: the gamma_n bound
    n = K + 2
    bound = n * U32 / (1 - n * U32) * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.abs()))
    assert got.shape == (M, N)
    assert bool(((got - want).abs() <= bound).all())
    # the bound tells a wrong kernel apart: one term of K missing moves a column by ~1e-2 of its size
    assert float(bound.max()) < 1e-4


@pytest.mark.parametrize("M,N,K,with_residual", [(1, 40, 100, True), (4, 33, 130, True), (2, 24, 64, False)])
def test_norm_gemv_equals_a_float64_reference(interpreter, M, N, K, with_residual):
    x, r, w, b, gamma = _case(M, N, K, torch.float32, seed=7 * M + N)
    r = r if with_residual else None
    eps = 1e-6
    y, r_out = mod.norm_gemv(x, w, b, gamma, eps, r, block_n=8)
    if r is None:
        assert r_out is x
    else:  # one float32 rounding of the sum: exactly torch's
        assert torch.equal(r_out, x + r)
    n64 = _normed64(x, r, gamma, eps)
    want = n64 @ w.double().T + b.double()
    # the normed row: a float32 sum of K squares and a few products: relative error <= (K + 8) u per element;
    # then the dot product's K + 2 roundings
    mag = n64.abs() @ w.double().abs().T + b.double().abs()
    bound = (2 * K + 12) * U32 * mag
    assert bool(((y.double() - want).abs() <= bound).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter rounds bf16 otherwise)")
@pytest.mark.parametrize("M,N,K", [(1, 2560, 2048), (4, 2048, 2048), (3, 5120, 1536)])
def test_norm_gemv_in_bf16_rounds_like_flashinfer(M, N, K):
    x, r, w, b, gamma = (t.cuda() for t in _case(M, N, K, torch.bfloat16, seed=3))
    y, r_out = mod.norm_gemv(x, w, b, gamma, 1e-6, r)
    assert mod.fits(x, w)
    assert torch.equal(r_out, (x.float() + r.float()).to(torch.bfloat16))
    # flashinfer's fused_add_rmsnorm: the norm over the unrounded float32 sum, rounded once to bf16; then the
    # projection accumulated in float32 and rounded once
    s = x.float() + r.float()
    n = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.float()).to(torch.bfloat16)
    want = n.float() @ w.float().T + b.float()
    # one bf16 rounding of the output, plus normed elements one bf16 ulp apart where float32's sums round apart
    bound = 2.0**-8 * want.abs() + 2.0**-8 * (n.float().abs() @ w.float().abs().T) * 2.0**-4 + 1e-6
    assert bool(((y.float() - want).abs() <= bound).all())
    assert torch.equal(mod.gemv(n, w, b), mod.linear(n, w, b))


def test_errors_and_the_fallback(interpreter):
    x, r, w, b, gamma = _case(5, 16, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most 4 rows"):
        mod.gemv(x, w)
    with pytest.raises(ValueError, match="at most 4 rows"):
        mod.gemv(torch.zeros(1, mod.MAX_K + 1), torch.zeros(4, mod.MAX_K + 1))
    with pytest.raises(ValueError, match="bias"):
        mod.gemv(x[:1], w, b[:3])
    with pytest.raises(ValueError, match="one dtype"):
        mod.gemv(x[:1], w.double())
    with pytest.raises(ValueError, match="residual"):
        mod.norm_gemv(x[:1], w, None, gamma, 1e-6, r[:2])
    with pytest.raises(ValueError, match="norm weight"):
        mod.norm_gemv(x[:1], w, None, gamma[:5], 1e-6)
    # on the CPU nothing fits: linear is F.linear, bit for bit
    assert not mod.fits(x[:1], w)
    assert torch.equal(mod.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("M,N,K,split", [(1, 40, 300, 128), (3, 17, 64, 64), (2, 9, 50, 2048)])
def test_down_parts_sum_to_the_product(interpreter, monkeypatch, M, N, K, split):
    """Split-K partials: ``cdiv(K, SPLIT_K)`` of them, each the product over its slice of K; their sum the product."""
    monkeypatch.setattr(mod, "SPLIT_K", split)
    x, _, w, _, _ = _case(M, N, K, torch.float32, seed=K + N)
    parts = mod.down_parts(x, w)
    assert parts.shape == (-(-K // split), M, N) and parts.dtype == torch.float32
    for p in range(parts.shape[0]):  # each part is its own slice's product: a wrong slice is off by O(1)
        sl = slice(p * split, (p + 1) * split)
        torch.testing.assert_close(parts[p].double(), x[:, sl].double() @ w[:, sl].double().T, rtol=0, atol=1e-5)
    n = K + 2
    bound = n * U32 / (1 - n * U32) * (x.double().abs() @ w.double().abs().T) * 2
    assert bool(((parts.double().sum(0) - x.double() @ w.double().T).abs() <= bound).all())
    assert torch.equal(mod.merge_parts(parts, torch.float32), parts.sum(0))
    assert mod.merge_parts(x, torch.bfloat16) is x


@pytest.mark.parametrize("S", [1, 3])
def test_norm_gemv_sums_parts_before_the_residual_add(interpreter, S):
    """The next block's qkv GEMV takes the previous block's down parts: the same result as on their sum."""
    M, N, K = 2, 24, 64
    g = torch.Generator().manual_seed(S)
    parts = torch.randn(S, M, K, generator=g)
    _, r, w, b, gamma = _case(M, N, K, torch.float32, seed=11)
    y, r_out = mod.norm_gemv(parts, w, b, gamma, 1e-6, r)
    merged = mod.merge_parts(parts, torch.float32)
    assert torch.equal(r_out, merged + r)
    want = _normed64(merged, r, gamma, 1e-6) @ w.double().T + b.double()
    mag = _normed64(merged, r, gamma, 1e-6).abs() @ w.double().abs().T + b.double().abs()
    assert bool(((y.double() - want).abs() <= (2 * K + 12 + 2 * S) * U32 * mag).all())
    with pytest.raises(ValueError, match="parts"):
        mod.norm_gemv(parts, w, b, gamma, 1e-6)  # parts need the residual they add to
    with pytest.raises(ValueError, match="parts"):
        mod.norm_gemv(parts.double(), w, b, gamma, 1e-6, r)
    with pytest.raises(ValueError, match="down_parts"):
        mod.down_parts(parts[0], w[:, :K - 1])


def test_norm_gemv_normed_returns_the_rows_it_projected(interpreter):
    """The MoE front: the same projection and residual as norm_gemv, plus the normed rows themselves."""
    M, N, K = 1, 24, 64
    x, r, w, _, gamma = _case(M, N, K, torch.float32, seed=21)
    y, r_out, normed = mod.norm_gemv_normed(x, w, gamma, 1e-6, r)
    y2, r2 = mod.norm_gemv(x, w, None, gamma, 1e-6, r)
    assert torch.equal(y, y2) and torch.equal(r_out, r2)
    n64 = _normed64(x, r, gamma, 1e-6)
    assert bool(((normed.double() - n64).abs() <= (K + 8) * U32 * n64.abs() + 1e-12).all())
    assert float((normed.double() - n64).abs().max()) < 1e-5
    parts = torch.stack([x, r])  # the previous block's output in parts, summed first
    y3, r3, normed3 = mod.norm_gemv_normed(parts, w, gamma, 1e-6, r)
    assert torch.equal(r3, (x + r) + r)
    torch.testing.assert_close(normed3.double(), _normed64(x + r, r, gamma, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("S,M,K", [(1, 1, 64), (6, 1, 100), (3, 4, 130)])
def test_norm_parts_is_the_final_norm_of_the_parts_sum(interpreter, S, M, K):
    """The model's last norm on decode's split-K parts: the parts' sum rounded once, plus the residual, normed with
    the arithmetic of the norm folded into the GEMVs (the same rows norm_gemv_normed projects)."""
    g = torch.Generator().manual_seed(S * K + M)
    parts = torch.randn(S, M, K, generator=g)
    _, r, w, _, gamma = _case(M, 8, K, torch.float32, seed=S + K)
    got = mod.norm_parts(parts, r, gamma, 1e-6)
    assert got.shape == (M, K) and got.dtype == torch.float32
    merged = mod.merge_parts(parts, torch.float32)
    n64 = _normed64(merged, r, gamma, 1e-6)
    # the parts' float32 sum (S - 1 roundings), the residual add, then the norm's (K + 8) u
    assert bool(((got.double() - n64).abs() <= (K + 8 + 2 * S) * U32 * n64.abs() + 1e-12).all())
    assert torch.equal(got, mod.norm_gemv_normed(parts, w, gamma, 1e-6, r)[2])
    with pytest.raises(ValueError, match="norm_parts"):
        mod.norm_parts(parts[0], r, gamma, 1e-6)  # not parts
    with pytest.raises(ValueError, match="norm_parts"):
        mod.norm_parts(parts, r[:, 1:], gamma, 1e-6)


def _norm_parts_reference(parts: torch.Tensor, r: torch.Tensor, gamma: torch.Tensor, eps: float):
    """torch's ``(new residual, s)``: the parts summed part by part in float32 (the kernel's order), rounded once to
    the residual's dtype, plus the residual in float32 (``s``, what the norm is computed over), rounded."""
    total = parts[0].clone()
    for p in range(1, parts.shape[0]):
        total += parts[p]
    s = total.to(r.dtype).float() + r.float()
    return s.to(r.dtype), s


@pytest.mark.parametrize("M,S,K", [(1, 1, 64), (3, 3, 100), (40, 4, 96)])
def test_norm_parts_returns_the_new_residual_where_asked(interpreter, M, S, K):
    """The add + RMSNorm after a multi-row split-K projection (parts_gemm): the new residual exactly torch's
    ``sum + residual``, the norm over it within float32's bound. One program per row: 40 rows as well as one. (In
    float32: the interpreter's float32 -> bf16 casts truncate rather than round; bf16 in the CUDA test below.)"""
    g = torch.Generator().manual_seed(M * K + S)
    parts = torch.randn(S, M, K, generator=g) * 4
    _, r, _, _, gamma = _case(M, 8, K, torch.float32, seed=S + K)
    normed, new_r = mod.norm_parts(parts, r, gamma, 1e-6, residual_out=True)
    assert normed.shape == new_r.shape == (M, K) and normed.dtype == new_r.dtype == torch.float32
    want_r, s = _norm_parts_reference(parts, r, gamma, 1e-6)
    assert torch.equal(new_r, want_r)
    n64 = _normed64(s, None, gamma, 1e-6)
    assert bool(((normed.double() - n64).abs() <= (K + 8) * U32 * n64.abs() + 1e-12).all())
    assert torch.equal(normed, mod.norm_parts(parts, r, gamma, 1e-6))  # without the residual: the same rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter truncates to bf16)")
@pytest.mark.parametrize("M,S", [(1, 3), (40, 4), (128, 2)])
def test_norm_parts_in_bf16_rounds_like_flashinfer(M, S):
    """bf16: the new residual bit for bit torch's ``round(round(sum) + residual)``; the norm over the unrounded
    float32 ``s``, rounded once (flashinfer's ``fused_add_rmsnorm``): within half a bf16 ulp plus float32's bound."""
    K = 2048
    g = torch.Generator().manual_seed(M)
    parts = (torch.randn(S, M, K, generator=g) * 4).cuda()
    _, r, _, _, gamma = (t.cuda() for t in _case(M, 8, K, torch.bfloat16, seed=S))
    normed, new_r = mod.norm_parts(parts, r, gamma, 1e-6, residual_out=True)
    want_r, s = _norm_parts_reference(parts, r, gamma, 1e-6)
    assert torch.equal(new_r, want_r)
    n64 = _normed64(s, None, gamma, 1e-6)
    delta = (K + 8) * U32
    assert bool(((normed.double() - n64).abs() <= (2.0**-8 * (1 + delta) + delta) * n64.abs() + 1e-12).all())


def test_row_parallel_linear_hands_parts_only_where_asked_and_too_wide(interpreter, monkeypatch):
    """o_proj's ``parts``: at a decode-sized batch with K past MAX_K (fused ops, no TP) the split-K parts, whose sum
    is the product; otherwise, or unasked, the plain product."""
    from epdserve.engine.distributed import TPGroup
    from epdserve.models.parallel import RowParallelLinear

    monkeypatch.setattr(mod, "MAX_K", 32)
    monkeypatch.setattr(mod, "SPLIT_K", 32)
    o = RowParallelLinear(80, 12, TPGroup.single())
    torch.nn.init.normal_(o.weight)
    o.fused = True
    x = torch.randn(1, 80, generator=torch.Generator().manual_seed(0))
    parts = o(x, parts=True)
    assert parts.shape == (3, 1, 12) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), F.linear(x, o.weight), rtol=1e-5, atol=1e-5)
    assert o(x).shape == (1, 12)  # unasked: the product
    assert o(torch.randn(mod.MAX_M + 1, 80), parts=True).dim() == 2  # past a decode-sized batch
    o.fused = False
    assert o(x, parts=True).dim() == 2  # torch ops (the CPU path)
