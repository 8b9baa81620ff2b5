"""The fused gate_up projection + SiLU-and-mul kernel (Triton): on the CPU through Triton's interpreter in float32
against a float64 ``silu(x @ Wg.T) * (x @ Wu.T)`` with a bound from float32's summation error (ragged M, I and K:
masks at every edge); on CUDA in bf16 against the unfused path (``F.linear`` then SiLU-and-mul), equal except where
the two GEMMs' summation orders round the gate or up product to neighbouring bf16 values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.models import gate_up_silu as mod

SILU_LIPSCHITZ = 1.1  # max |silu'(g)| = 1.0998 (at g = 2.40)


def _case(M: int, inter: int, K: int, device: str, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=g).to(dtype)
    # scaled so that gate and up are O(1): SiLU's curved part, not only its linear tail or zero
    w = (torch.randn(2 * inter, K, device=device, generator=g) * K ** -0.5).to(dtype)
    return x, w


def _products(x: torch.Tensor, w: torch.Tensor):
    """float64 gate and up, and Σ_k |x_k w_k| of each (what a float32 summation error is proportional to)."""
    inter = w.shape[0] // 2
    x64, w64 = x.double(), w.double()
    prod, mag = x64 @ w64.T, x64.abs() @ w64.abs().T
    return prod[:, :inter], prod[:, inter:], mag[:, :inter], mag[:, inter:]


@pytest.mark.parametrize("M,inter,K,block_n,block_k,strided", [
    (1, 40, 100, 16, 32, False),   # I = 2.5 column blocks, K = 3 blocks + 4 (one row: the GEMV kernel)
    (1, 21, 2100, 16, 256, True),  # one row past GEMV_MAX_K: the tl.dot kernel
    (5, 70, 200, 32, 64, True),    # I tail 6, K tail 8; x and w row slices of wider tensors
    (32, 100, 130, 64, 128, False),  # I tail 36, K tail 2, a full 32-row tile
    (32, 33, 64, 16, 16, True),
])
def test_equals_a_float64_reference_on_the_interpreter(interpreter, M, inter, K, block_n, block_k, strided):
    x, w = _case(M, inter, K + 3 if strided else K, "cpu", torch.float32, seed=M * inter + K)
    if strided:  # row strides of K + 3: the kernel must use the strides, not K
        x, w = x[:, :K], w[:, :K]
    got = mod.gate_up_silu(x, w, block_n, block_k).double()
    g, u, g_mag, u_mag = _products(x, w)
    want = F.silu(g) * u
    # float32's summation error (the gamma_n bound): each product is rounded once, then passes through at most
    # block_k - 1 additions inside a tl.dot, in any order, and one per K block into the accumulator; each of those n
    # roundings is off by at most 2^-24 of a partial sum, itself at most Σ_k |x_k w_k|
    n = block_k + -(-K // block_k)
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    dg, du = gamma * g_mag, gamma * u_mag
    # propagated through silu(g) * u (silu is 1.1-Lipschitz), plus float32's few roundings in exp, 1 + e, / and *
    bound = SILU_LIPSCHITZ * dg * (u.abs() + du) + F.silu(g).abs() * du
    bound += 8 * 2.0**-24 * (want.abs() + bound)
    err = (got - want).abs()
    print(f"M={M} I={inter} K={K} block {block_n}x{block_k}: max |error| {float(err.max()):.2e}, worst "
          f"{float((err / bound).max()):.2f} of the bound (bound at most {float(bound.max()):.1e})")
    assert got.shape == (M, inter)
    assert bool((err <= bound).all())
    # the bound still tells a wrong kernel apart: one term of K missing moves g by ~1e-2 of its size
    assert float(bound.max()) < 1e-3 * float(want.abs().max())


@pytest.mark.parametrize("M,inter,K,with_residual", [(1, 40, 100, True), (1, 9, 64, False), (4, 70, 200, True),
                                                     (3, 33, 64, False)])
def test_norm_folded_in_equals_a_float64_reference(interpreter, M, inter, K, with_residual):
    x, w = _case(M, inter, K, "cpu", torch.float32, seed=M + inter + K)
    g = torch.Generator().manual_seed(K)
    r = torch.randn(M, K, generator=g) if with_residual else None
    gamma = 1 + 0.5 * torch.randn(K, generator=g)
    got, r_out = mod.norm_gate_up_silu(x, w, gamma, 1e-6, r, block_n=16, block_k=32)
    if r is None:
        assert r_out is x
    else:  # one float32 rounding of the sum: exactly torch's
        assert torch.equal(r_out, x + r)
    s = x.double() + (0 if r is None else r.double())
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.double()
    gate, up, g_mag, u_mag = _products(normed, w)
    want = F.silu(gate) * up
    # the normed row's float32 error ((K + 8) u relative per element: a K-term sum of squares, rsqrt and two
    # products), then the dot products' block_k + K / block_k roundings, as in the test above
    n = 32 + -(-K // 32) + K + 8
    dg, du = n * 2.0**-24 * g_mag, n * 2.0**-24 * u_mag
    bound = SILU_LIPSCHITZ * dg * (up.abs() + du) + F.silu(gate).abs() * du
    bound += 8 * 2.0**-24 * (want.abs() + bound)
    assert got.shape == (M, inter)
    assert bool(((got.double() - want).abs() <= bound).all())
    with pytest.raises(ValueError, match="at most 4 rows"):
        mod.norm_gate_up_silu(torch.zeros(5, K), w, gamma, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        mod.norm_gate_up_silu(x, w, gamma, 1e-6, torch.zeros(M, K + 1))


def test_bad_inputs_raise():
    x, w = torch.zeros(2, 32), torch.zeros(40, 32)
    with pytest.raises(ValueError, match="M <= 64"):
        mod.gate_up_silu(torch.zeros(65, 32), w)
    with pytest.raises(ValueError, match=r"w \[2I, K\]"):
        mod.gate_up_silu(x, torch.zeros(40, 33))
    with pytest.raises(ValueError, match=r"w \[2I, K\]"):
        mod.gate_up_silu(x, torch.zeros(39, 32))
    with pytest.raises(ValueError, match=r"w \[2I, K\]"):
        mod.gate_up_silu(x[0], w)
    with pytest.raises(ValueError, match="one dtype"):
        mod.gate_up_silu(x, w.double())
    with pytest.raises(ValueError, match="one dtype"):
        mod.gate_up_silu(x.double(), w.double())
    with pytest.raises(ValueError, match="contiguous"):
        mod.gate_up_silu(torch.zeros(32, 2).T, w)
    with pytest.raises(ValueError, match="power-of-two block_n"):
        mod.gate_up_silu(x, w, block_n=24)
    with pytest.raises(ValueError, match="power-of-two block_n"):
        mod.gate_up_silu(x, w, block_k=8)
    with pytest.raises(ValueError, match="num_stages"):
        mod.gate_up_silu(x, w, num_stages=0)


def test_empty_batch_and_empty_k_launch_nothing():
    assert mod.gate_up_silu(torch.zeros(0, 32), torch.zeros(40, 32)).shape == (0, 20)
    assert torch.equal(mod.gate_up_silu(torch.zeros(3, 0), torch.zeros(40, 0)), torch.zeros(3, 20))


def _bf16_window(g, u, g_mag, u_mag, K):
    """Per element, the lowest and highest bf16 result that linear-then-SiLU-and-mul can give: gate and up each
    rounded from any float32 sum within the summation-error bound of the exact one, then silu(g) * u in float32
    (with up to 2^-18 relative difference from the exp's approximation) rounded to bf16. Where no rounding boundary
    lies within the bounds the window is one value; the bounds are the worst case of any summation order, so about
    half the elements get two or more (on an H200 the fused and unfused results were bitwise equal everywhere)."""
    # tensor cores add k-chunks of exact bf16 products into the float32 accumulator: at most K/16 + 8 rounded adds
    # on any path, each off by at most 2^-23 (truncated, not only rounded to nearest) of Σ|x_k w_k|
    gamma = (K / 16 + 8) * 2.0**-23
    gates = [(g - gamma * g_mag).bfloat16(), (g + gamma * g_mag).bfloat16()]
    ups = [(u - gamma * u_mag).bfloat16(), (u + gamma * u_mag).bfloat16()]
    outs = []
    for gb in gates:
        for ub in ups:
            y = F.silu(gb.float()) * ub.float()
            outs += [(y * (1 - 2.0**-18)).bfloat16(), (y * (1 + 2.0**-18)).bfloat16()]
    outs = torch.stack(outs).float()
    return outs.amin(0), outs.amax(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 32, 64])
def test_bf16_on_cuda_equals_linear_then_silu_and_mul(M):
    K, inter = 2048, 11008  # Qwen2.5-VL-3B's MLP
    x, w = _case(M, inter, K, "cuda", torch.bfloat16, seed=M)
    gate_up = F.linear(x, w)  # the unfused path: cuBLAS, then SiLU-and-mul from the bf16 gate and up
    unfused = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).bfloat16().float()
    g, u, g_mag, u_mag = _products(x, w)
    want = F.silu(g) * u
    lo, hi = _bf16_window(g, u, g_mag, u_mag, K)
    assert bool(((unfused >= lo) & (unfused <= hi)).all()), "the window does not hold the unfused path"
    exact = (F.silu(g.bfloat16().float()) * u.bfloat16().float()).bfloat16().float()
    for cfg in [()] + (mod.CONFIGS if M == 32 else []):  # the defaults, and at M = 32 every benchmarked config
        got = mod.gate_up_silu(x, w, *cfg).float()
        outside = int(((got < lo) | (got > hi)).sum())
        same = float((got == unfused).float().mean())
        err, err_unfused = float((got - want).abs().mean()), float((unfused - want).abs().mean())
        print(f"M={M} {cfg or 'defaults'}: {same:.4%} equal to the unfused path, mean |error| {err:.3e} (unfused "
              f"{err_unfused:.3e}), {outside} outside the window ({float((lo != hi).float().mean()):.1%} wider "
              f"than one value)")
        assert got.shape == (M, inter) and outside == 0
        # the tight check, against the correctly rounded result (g and u rounded from their float64 values): a
        # float32 sum of these 2048 terms is typically ~2^-20 of |g| off, so the bf16 rounding of g or of u flips
        # for ~2^-12 of the elements each, ~5e-4 of the outputs, in any summation order. The kernel must be
        # correctly rounded as often as the unfused path, up to 5e-4 of the outputs. (Agreement with the unfused
        # path itself is no test of accuracy: the tl.dot kernel sums in cuBLAS's order and agreed everywhere on an
        # H200; the one-row GEMV's tree reductions differed from it in 0.12 % of the outputs, exactly those where
        # cuBLAS's sums were the ones not correctly rounded.)
        wrong, wrong_unfused = float((got != exact).float().mean()), float((unfused != exact).float().mean())
        print(f"  not correctly rounded: {wrong:.4%} (unfused {wrong_unfused:.4%})")
        assert wrong <= wrong_unfused + 5e-4
        # no worse than the unfused path against float64, but for those flips
        assert err <= err_unfused * 1.01
