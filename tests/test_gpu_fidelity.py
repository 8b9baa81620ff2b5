"""GPU fidelity of the decode path (issue 44's rule): greedy tokens from the bf16 model runner with CUDA graphs and
every fused kernel are near-tie equal to transformers' float32 forward of the same checkpoint: each token is
transformers' argmax, or within 0.5 nats of it by transformers' own logits. Batches 1 and 3 run the decode GEMV with
the norms folded in (epdserve.models.decode_gemv), batch 16 the cuBLAS path. GPU only; skipped on the CPU.

Models: the ``gpu_model`` fixture (conftest.py): the small checkpoints and a shallow copy of each preset.
"""

from __future__ import annotations

import pytest
import torch

from epdserve.engine.model_runner import ModelRunner
from test_cuda_graph import greedy

MARGIN_NATS = 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_decode_is_near_tie_equal_to_transformers_float32(gpu_model):
    pytest.importorskip("flashinfer")
    from transformers import AutoModelForImageTextToText

    runner = ModelRunner(gpu_model, device=torch.device("cuda"), dtype=torch.bfloat16, num_pages=2048, page_size=16,
                         cuda_graph_max_bs=16)
    hf = AutoModelForImageTextToText.from_pretrained(gpu_model, dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    vocab = min(runner.config.vocab_size, 1000)  # the small checkpoint's tokenizer has fewer than 1000 ids
    steps, checked, ties, worst = 32, 0, 0, 0.0
    for n in (1, 3, 16):
        prompts = [torch.randint(10, vocab, (int(L),), generator=gen).tolist()
                   for L in torch.randint(5, 300, (n,), generator=gen)]
        for prompt, out in zip(prompts, greedy(runner, prompts, steps)):
            ids = torch.tensor([prompt + out], device="cuda")
            with torch.no_grad():  # teacher-forced on our tokens: one float32 forward scores every step
                logp = hf(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            ours = logp.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            gap = logp.max(-1).values - ours  # 0 where our token is transformers' argmax
            assert float(gap.max()) <= MARGIN_NATS, (
                f"batch {n}: step {int(gap.argmax())} took a token {float(gap.max()):.3f} nats below transformers' "
                f"float32 argmax")
            checked += len(out)
            ties += int((gap > 0).sum())
            worst = max(worst, float(gap.max()))
    print(f"{runner.config.num_layers} layers: {checked} greedy tokens at batch 1, 3, 16; {ties} not transformers' "
          f"float32 argmax, all within {worst:.3f} nats of it")
