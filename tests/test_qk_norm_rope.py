"""The fused Qwen3 q/k RMSNorm + RoPE kernel (CUDA, Triton) against the unfused pair it replaces (flashinfer's
rmsnorm, then the in-place RoPE kernel), and both against a float32 reference: the fused one is never further from
float32 than the pair."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(T: int, hq: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device="cuda", generator=g).to(torch.bfloat16) * 3
    qw = (1 + 0.3 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    pos = torch.arange(T, device="cuda").float()[:, None] * 37.0
    inv = 1.0 / (5e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    table = torch.cat([torch.cos(pos * inv), torch.sin(pos * inv)], dim=1).contiguous()
    return qkv, qw, kw, table


def _float32(qkv, hq, hkv, d, qw, kw, eps, table):
    x = qkv.float()[:, : (hq + hkv) * d].view(-1, hq + hkv, d)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = torch.cat([y[:, :hq] * qw.float(), y[:, hq:] * kw.float()], dim=1)
    cos, sin = table[:, None, : d // 2], table[:, None, d // 2:]
    y1, y2 = y[..., : d // 2], y[..., d // 2:]
    out = torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1)
    return out[:, :hq], out[:, hq:]


def _flashinfer_pair(qkv, hq, hkv, d, qw, kw, eps, table):
    import flashinfer

    from epdserve.models.rope_inplace import rope_inplace

    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = flashinfer.norm.rmsnorm(q.reshape(-1, d), qw, eps).view(-1, hq * d)
    k = flashinfer.norm.rmsnorm(k.reshape(-1, d), kw, eps).view(-1, hkv * d)
    rope_inplace(q, k, d, table)
    return q.view(-1, hq, d), k.view(-1, hkv, d)


@pytest.mark.parametrize("T,hq,hkv,d", [(1, 32, 8, 128), (7, 16, 8, 128), (300, 4, 2, 64), (0, 32, 8, 128)])
def test_fused_matches_the_flashinfer_pair_and_float32(T, hq, hkv, d):
    from epdserve.models.qk_norm_rope import qk_norm_rope

    eps = 1e-6
    qkv, qw, kw, table = _inputs(T, hq, hkv, d)
    q, k = qk_norm_rope(qkv, hq, hkv, d, qw, kw, eps, table)
    assert q.shape == (T, hq, d) and k.shape == (T, hkv, d) and q.is_contiguous() and k.is_contiguous()
    if not T:
        print(f"T=0 hq={hq} hkv={hkv} d={d}: empty q and k of the right shapes")
        return
    rq, rk = _flashinfer_pair(qkv, hq, hkv, d, qw, kw, eps, table)
    fq, fk = _float32(qkv, hq, hkv, d, qw, kw, eps, table)
    for got, pair, ref in ((q, rq, fq), (k, rk, fk)):
        # Both round twice to bf16 (after the norm, after RoPE); only the float32 sum's order differs.
        same = (got == pair).float().mean().item()
        assert same > 0.99, f"only {same:.4f} of the elements equal the flashinfer pair's"
        err_fused, err_pair = (got.float() - ref).abs().max().item(), (pair.float() - ref).abs().max().item()
        assert err_fused <= err_pair * 1.01 + 1e-6, (err_fused, err_pair)
        print(f"T={T} hq={hq} hkv={hkv} d={d}: {same:.4f} equal to the flashinfer pair (bound > 0.99); "
              f"max |error| vs float32 {err_fused:.3g}, the pair's {err_pair:.3g} (bound 1.01x)")


def test_bad_shapes_are_refused():
    from epdserve.models.qk_norm_rope import qk_norm_rope

    qkv, qw, kw, table = _inputs(4, 4, 2, 64)
    with pytest.raises(ValueError):
        qk_norm_rope(qkv, 4, 2, 64, qw, kw, 1e-6, table[:3])
    with pytest.raises(ValueError):
        qk_norm_rope(qkv, 4, 2, 64, qw, kw, 1e-6, table.double())
