"""The LM head's logits: float32 straight from the GEMM on CUDA (one rank), rounded to the activation dtype
elsewhere (:class:`~epdserve.models.parallel.ParallelLMHead`)."""

from __future__ import annotations

import pytest
import torch

from epdserve.engine.distributed import TPGroup
from epdserve.models.parallel import ParallelLMHead


def _head(vocab: int, hidden: int, dtype: torch.dtype, device: str) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, TPGroup.single())
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.05)
    return head.to(device=device, dtype=dtype)


def test_cpu_logits_are_rounded_then_copied_into_out():
    head, x = _head(300, 64, torch.bfloat16, "cpu"), torch.randn(3, 64).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, head.weight)
    assert head(x).dtype == torch.bfloat16 and torch.equal(head(x), want)
    out = torch.full((3, 300), float("nan"))
    assert head(x, out) is out and torch.equal(out, want.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 32, 128])
def test_cuda_logits_are_the_float32_accumulator(rows):
    """Against a float64 product of the same bf16 operands: within float32 accumulation error (K * 2**-24 * sum of
    |x w| per logit, a bound on any summation order), so the logits are not rounded to bf16 (whose error near the
    largest logits would be ~1000x that); ``out`` given or not, the same bits; inside a CUDA graph too."""
    vocab, hidden = 151936, 2048
    head = _head(vocab, hidden, torch.bfloat16, "cuda")
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (rows, vocab)
    exact = x.double() @ head.weight.double().t()
    bound = hidden * 2.0 ** -24 * (x.double().abs() @ head.weight.double().abs().t())
    assert ((got.double() - exact).abs() <= bound).all()
    assert not torch.equal(got, got.to(torch.bfloat16).float())  # not bf16 values
    out = torch.empty(rows, vocab, device="cuda")
    assert head(x, out) is out and torch.equal(out, got)
    graph, out2 = torch.cuda.CUDAGraph(), torch.empty_like(out)
    head(x, out2)  # cuBLAS's workspace before capture
    with torch.cuda.graph(graph):
        head(x, out2)
    out2.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out2, got)
