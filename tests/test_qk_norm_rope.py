"""The fused Qwen3 q/k RMSNorm + RoPE kernel (CUDA, Triton) against the unfused pair it replaces (flashinfer's
rmsnorm, then the in-place RoPE kernel), and both against a float32 reference: the fused one is never further from
float32 than the pair."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdserve.attention.base import KVWrite
from epdserve.models import qk_norm_rope as mod



def _inputs(T: int, hq: int, hkv: int, d: int, seed: int = 0, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=device, generator=g).to(torch.bfloat16) * 3
    qw = (1 + 0.3 * torch.randn(d, device=device, generator=g)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(d, device=device, generator=g)).to(torch.bfloat16)
    pos = torch.arange(T, device=device).float()[:, None] * 37.0
    inv = 1.0 / (5e6 ** (torch.arange(0, d, 2, device=device).float() / d))
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
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bad_shapes_are_refused():
    from epdserve.models.qk_norm_rope import qk_norm_rope

    qkv, qw, kw, table = _inputs(4, 4, 2, 64)
    with pytest.raises(ValueError):
        qk_norm_rope(qkv, 4, 2, 64, qw, kw, 1e-6, table[:3])
    with pytest.raises(ValueError):
        qk_norm_rope(qkv, 4, 2, 64, qw, kw, 1e-6, table.double())


def _check_kv_write(T, hq, hkv, d, device):
    """q and k equal to the call without ``kv_write``; the rotated k and the raw v at each token's (shuffled) slot;
    no other slot written."""
    qkv, qw, kw, table = _inputs(T, hq, hkv, d, device=device)
    q0, k0 = mod.qk_norm_rope(qkv, hq, hkv, d, qw, kw, 1e-6, table)
    cache = torch.randn(2, 3 * T + 5, hkv, d, device=device).to(torch.bfloat16)
    before = cache.clone()
    slots = torch.randperm(cache.shape[1], device=device)[:T]
    q, k = mod.qk_norm_rope(qkv, hq, hkv, d, qw, kw, 1e-6, table, kv_write=KVWrite(cache[0], cache[1], slots))
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(cache[0, slots], k0)
    assert torch.equal(cache[1, slots].reshape(T, -1), qkv[:, (hq + hkv) * d:])
    others = torch.ones(cache.shape[1], dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(cache[:, others], before[:, others])


def test_kv_write_on_the_interpreter():
    """In a subprocess: the kernel's ``tl.sum`` is a Triton function that runs under the interpreter only when
    ``TRITON_INTERPRET=1`` is set before Triton is first imported."""
    pytest.importorskip("triton")
    code = ("import sys; sys.path.insert(0, 'tests'); from test_qk_norm_rope import _check_kv_write; "
            "_check_kv_write(3, 4, 2, 16, 'cpu'); _check_kv_write(2, 8, 4, 64, 'cpu'); print('ok')")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 32, 8, 128), (77, 32, 8, 128)])
def test_kv_write_on_cuda(T, hq, hkv, d):
    _check_kv_write(T, hq, hkv, d, "cuda")
