"""The in-place RoPE kernel (Triton) against a float32 reference: on CPU through Triton's interpreter (which rounds
float32 to bfloat16 toward zero, so within one bfloat16 ulp), on CUDA the reference rounded to nearest."""

from __future__ import annotations

import pytest
import torch

from epdserve.attention.base import KVWrite
from epdserve.models import rope_inplace as mod


def _case(T: int, hq: int, hkv: int, d: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hkv) * d, device=device, generator=g) * 3).to(torch.bfloat16)
    # M-RoPE-like angles: each token its own positions, not a row of one cache
    pos = torch.randint(0, 30000, (T, 1), device=device, generator=g).float()
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    table = torch.cat([torch.cos(pos * inv), torch.sin(pos * inv)], dim=1).contiguous()
    x = qkv.float()[:, : (hq + hkv) * d].view(T, hq + hkv, d)
    cos, sin = table[:, None, : d // 2], table[:, None, d // 2:]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    # float32's own rounding of the two products and their sum: where they nearly cancel, a result near zero
    # carries an absolute error of a few float32 ulps of the products, many bfloat16 ulps of the result
    noise = 4 * 2.0**-24 * torch.cat([(x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()], -1)
    return qkv, table, ref, noise


def _ulp(ref: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each value's magnitude (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)


def _errors(got: torch.Tensor, ref: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Each value's error in bfloat16 ulps of the reference, after float32's rounding noise is taken off."""
    return ((got - ref).abs() - noise).clamp_min(0) / _ulp(ref)


def _rotate_qkv_views(qkv, hq, hkv, d, table):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided column views of one buffer
    v_before = v.clone()
    mod.rope_inplace(q, k, d, table)
    assert torch.equal(v, v_before), "the v heads after q and k were written"
    return qkv[:, : (hq + hkv) * d].float().view(qkv.shape[0], hq + hkv, d)



@pytest.mark.parametrize("T,hq,hkv,d", [(7, 3, 2, 16), (3, 16, 2, 128), (1, 4, 4, 64)])
def test_rotation_on_the_interpreter(interpreter, T, hq, hkv, d):
    qkv, table, ref, noise = _case(T, hq, hkv, d, "cpu")
    got = _rotate_qkv_views(qkv, hq, hkv, d, table)
    err = _errors(got, ref, noise)
    print(f"T={T} heads {hq}/{hkv} head_dim {d}: worst error {float(err.max()):.3f} bf16 ulp (interpreter rounds "
          f"toward zero: < 1)")
    assert float(err.max()) < 1.0


def test_bad_inputs_raise_and_write_nothing():
    qkv, table, *_ = _case(4, 2, 1, 16, "cpu")
    q, k, _ = qkv.split([32, 16, 16], dim=-1)
    before = qkv.clone()
    with pytest.raises(ValueError, match="float32"):
        mod.rope_inplace(q, k, 16, table.to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        mod.rope_inplace(q, k, 16, table[:3])
    with pytest.raises(ValueError, match="power-of-two"):
        mod.rope_inplace(q, k, 12, table)
    with pytest.raises(ValueError, match="whole heads"):
        mod.rope_inplace(q[:, :24], k, 16, table)
    with pytest.raises(ValueError, match="one dtype"):
        mod.rope_inplace(q, k.half(), 16, table)
    assert torch.equal(qkv, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,hq,hkv", [(1, 16, 2), (77, 16, 2), (4096, 28, 4), (5, 8, 1)])
def test_rotation_on_cuda_rounds_to_nearest(T, hq, hkv):
    qkv, table, ref, noise = _case(T, hq, hkv, 128, "cuda")
    got = _rotate_qkv_views(qkv, hq, hkv, 128, table)
    err = _errors(got, ref, noise)
    off = float((got != ref.to(torch.bfloat16).float()).float().mean())
    print(f"T={T} heads {hq}/{hkv}: worst error {float(err.max()):.3f} bf16 ulp; {off:.2e} of the values differ from "
          f"the float32 reference rounded to nearest (float32 sums in another order)")
    assert float(err.max()) <= 0.5 and off < 1e-3


def _kv_write_case(T, hq, hkv, d, device):
    """Rotate a qkv buffer's views twice, once plainly and once storing K and V in slot views of a page buffer
    (shuffled slots); returns both buffers, the cache, the slots and the cache's untouched copy."""
    qkv, table, *_ = _case(T, hq, hkv, d, device)
    plain = qkv.clone()
    q, k, _ = plain.split([hq * d, hkv * d, hkv * d], dim=-1)
    mod.rope_inplace(q, k, d, table)
    cache = torch.randn(2, 4 * T + 8, hkv, d, device=device).to(qkv.dtype)  # [K|V, slots, H, D], like one layer
    before = cache.clone()
    slots = torch.randperm(cache.shape[1], device=device)[:T]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    mod.rope_inplace(q, k, d, table, v=v, kv_write=KVWrite(cache[0], cache[1], slots))
    return qkv, plain, cache, slots, before


def _check_kv_write(qkv, plain, cache, slots, before, hq, hkv, d):
    T = qkv.shape[0]
    assert torch.equal(qkv, plain), "q and k rotated as without kv_write, v untouched"
    k_rot, v = plain[:, hq * d:(hq + hkv) * d], plain[:, (hq + hkv) * d:]
    assert torch.equal(cache[0, slots].reshape(T, -1), k_rot), "the rotated K at each token's slot"
    assert torch.equal(cache[1, slots].reshape(T, -1), v), "V at each token's slot, as it was"
    others = torch.ones(cache.shape[1], dtype=torch.bool, device=cache.device)
    others[slots] = False
    assert torch.equal(cache[:, others], before[:, others]), "no other slot written"


@pytest.mark.parametrize("T,hq,hkv,d", [(7, 3, 2, 16), (3, 16, 2, 128), (2, 28, 4, 128)])
def test_kv_write_on_the_interpreter(interpreter, T, hq, hkv, d):
    _check_kv_write(*_kv_write_case(T, hq, hkv, d, "cpu"), hq, hkv, d)


def test_bad_kv_write_raises():
    qkv, table, *_ = _case(4, 2, 1, 16, "cpu")
    q, k, v = qkv.split([32, 16, 16], dim=-1)
    cache = torch.zeros(2, 9, 1, 16, dtype=qkv.dtype)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="needs v"):
        mod.rope_inplace(q, k, 16, table, kv_write=KVWrite(cache[0], cache[1], slots))
    with pytest.raises(ValueError, match="k_slots"):
        mod.rope_inplace(q, k, 16, table, v=v, kv_write=KVWrite(cache[0].float(), cache[1], slots))
    with pytest.raises(ValueError, match="v_slots"):
        mod.rope_inplace(q, k, 16, table, v=v, kv_write=KVWrite(cache[0], cache[1, :, :, :8], slots))
    with pytest.raises(ValueError, match="slots must be int64"):
        mod.rope_inplace(q, k, 16, table, v=v, kv_write=KVWrite(cache[0], cache[1], slots.int()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,hq,hkv", [(1, 16, 2), (77, 16, 2), (4096, 28, 4)])
def test_kv_write_on_cuda(T, hq, hkv):
    _check_kv_write(*_kv_write_case(T, hq, hkv, 128, "cuda"), hq, hkv, 128)
