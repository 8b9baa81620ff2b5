"""The one-row layer front (epdserve.models.decode_qkv.norm_qkv_rope: add + RMSNorm, qkv projection, RoPE, K/V to
the cache) on the CPU through Triton's interpreter in float32, against a float64 reference with a bound from
float32's rounding; the cached K and V are the returned ones, V passes through unrotated, the residual is exact."""

from __future__ import annotations

import pytest
import torch

from epdserve.attention.base import KVWrite
from epdserve.models import decode_qkv as mod

U32 = 2.0**-24
HQ, HKV, D, K = 4, 2, 16, 48


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = (HQ + 2 * HKV) * D
    w = torch.randn(n, K, generator=g) * K ** -0.5
    b = torch.randn(n, generator=g)
    gamma = 1 + 0.5 * torch.randn(K, generator=g)
    r = torch.randn(1, K, generator=g)
    angles = torch.rand(D // 2, generator=g) * 6
    table = torch.cat([angles.cos(), angles.sin()])[None, :].float()
    return g, w, b, gamma, r, table


def _reference(s, w, b, gamma, table, eps=1e-6):
    """float64: the normed row, its projection, q and k heads rotated (NeoX halves); and |terms| for the bound."""
    s = s.double()
    n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    a = (n @ w.double().T + b.double())[0].view(-1, D)
    mag = ((n.abs() @ w.double().abs().T) + b.double().abs())[0].view(-1, D)
    cos, sin = table[0, :D // 2].double(), table[0, D // 2:].double()
    out = a.clone()
    x1, x2 = a[:HQ + HKV, :D // 2], a[:HQ + HKV, D // 2:]
    out[:HQ + HKV, :D // 2] = x1 * cos - x2 * sin
    out[:HQ + HKV, D // 2:] = x2 * cos + x1 * sin
    m1, m2 = mag[:, :D // 2], mag[:, D // 2:]
    bound = torch.cat([m1 + m2, m1 + m2], dim=1) * (2 * K + 20) * U32 + out.abs() * 4 * U32
    return out, bound


@pytest.mark.parametrize("parts,write", [(0, True), (2, True), (0, False)])
def test_norm_qkv_rope_equals_a_float64_reference(interpreter, parts, write):
    g, w, b, gamma, r, table = _case(parts + 3 * write)
    if parts:
        x = torch.randn(parts, 1, K, generator=g)
        s = x.sum(0) + r
    else:
        x = torch.randn(1, K, generator=g)
        s = x + r
    kc, vc = torch.zeros(10, HKV, D), torch.zeros(10, HKV, D)
    kv = KVWrite(kc, vc, torch.tensor([7])) if write else None
    y, r_out = mod.norm_qkv_rope(x, w, b, gamma, 1e-6, r, D, HQ, HKV, table, kv)
    assert torch.equal(r_out, s)  # one float32 rounding of the sum, as torch's
    want, bound = _reference(s, w, b, gamma, table)
    got = y[0].double().view(-1, D)
    assert bool(((got - want).abs() <= bound).all())
    # a wrong pairing or sign is off by O(1), far outside the bound
    assert float(bound.max()) < 1e-3
    if write:
        assert torch.equal(kc[7], y[0, HQ * D:(HQ + HKV) * D].view(HKV, D))
        assert torch.equal(vc[7], y[0, (HQ + HKV) * D:].view(HKV, D))
        assert not kc[:7].any() and not vc[8:].any()


def test_first_block_and_errors(interpreter):
    g, w, b, gamma, r, table = _case(5)
    x = torch.randn(1, K, generator=g)
    y, r_out = mod.norm_qkv_rope(x, w, None, gamma, 1e-6, None, D, HQ, HKV, table, None)
    assert r_out is x
    want, bound = _reference(x, w, torch.zeros_like(b), gamma, table)
    assert bool(((y[0].double().view(-1, D) - want).abs() <= bound).all())
    with pytest.raises(ValueError, match="one row"):
        mod.norm_qkv_rope(torch.randn(2, K), w, b, gamma, 1e-6, None, D, HQ, HKV, table, None)
    with pytest.raises(ValueError, match="heads"):
        mod.norm_qkv_rope(x, w, b, gamma, 1e-6, None, D, HQ + 1, HKV, table, None)
    with pytest.raises(ValueError, match="table"):
        mod.norm_qkv_rope(x, w, b, gamma, 1e-6, None, D, HQ, HKV, table[:, :D // 2], None)
    with pytest.raises(ValueError, match="residual"):
        mod.norm_qkv_rope(torch.randn(2, 1, K), w, b, gamma, 1e-6, None, D, HQ, HKV, table, None)
    assert not mod.fits(x, w, D)  # CPU: the layer keeps its two-kernel path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter rounds bf16 otherwise)")
def test_one_launch_equals_the_two_kernel_path_in_bf16():
    """The 3B preset's layer front (16 q / 2 KV heads of 128, hidden 2048) in bf16: q, k, v and the cached K/V of
    the one launch against decode_gemv.norm_gemv then rope_inplace with the KV write; the projections' float32
    sums may round to neighbouring bf16 values, so each element is within one bf16 ulp of the inputs RoPE mixes
    plus one of its own."""
    from epdserve.models import decode_gemv
    from epdserve.models.rope_inplace import rope_inplace

    hq, hkv, d, k = 16, 2, 128, 2048
    g = torch.Generator().manual_seed(0)
    n = (hq + 2 * hkv) * d
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
    b = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    gamma = (1 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16).cuda()
    x, r = (torch.randn(1, k, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    angles = torch.rand(d // 2, generator=g) * 100
    table = torch.cat([angles.cos(), angles.sin()])[None, :].float().cuda()
    caches = [torch.zeros(4, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    slot = torch.tensor([2], device="cuda")
    assert mod.fits(x, w, d)
    y, r1 = mod.norm_qkv_rope(x, w, b, gamma, 1e-6, r, d, hq, hkv, table, KVWrite(caches[0], caches[1], slot))
    ref, r2 = decode_gemv.norm_gemv(x, w, b, gamma, 1e-6, r)
    unrotated = ref.float().clone()
    q, kk, v = ref.split([hq * d, hkv * d, hkv * d], dim=-1)
    rope_inplace(q, kk, d, table, v=v, kv_write=KVWrite(caches[2], caches[3], slot))
    assert torch.equal(r1, r2)
    pairs = unrotated.view(-1, 2, d // 2).abs().sum(1, keepdim=True).expand(-1, 2, -1).reshape(1, -1)
    bound = 2.0**-7 * pairs + 2.0**-7 * ref.float().abs()  # inputs a bf16 ulp apart; each output rounded once
    assert bool(((y.float() - ref.float()).abs() <= bound).all())
    assert torch.equal(caches[0][2], y[0, hq * d:(hq + hkv) * d].view(hkv, d))
    assert torch.equal(caches[1][2], y[0, (hq + hkv) * d:].view(hkv, d))
