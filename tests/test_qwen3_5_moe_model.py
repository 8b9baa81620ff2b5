"""Qwen3.5-MoE's language model (hybrid Qwen3.5 decoder, every MLP a routed-expert block with a gated shared expert)
against transformers on CPU: the block bit for bit in float32, both checkpoint layouts of the experts (released
fused tensors; one tensor per expert, what ``save_pretrained`` writes), prefill logits and greedy decoding over the
paged KV and the state pool, two requests batched."""

from __future__ import annotations

import pytest
import torch
from test_qwen3_5_model import assert_batch_equals_each_alone, assert_prefill_and_greedy_equal_transformers

from epdserve.engine.distributed import TPGroup
from epdserve.engine.model_runner import ModelRunner
from epdserve.models.config import ModelConfig
from epdserve.models.qwen3_5_moe_lm import SharedExpertMoeBlock, fuse_per_expert

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf_moe(tiny_qwen3_5_moe_path):
    # transformers' eager experts: the per-expert loop the bitwise checks follow (its CPU default may be grouped_mm,
    # the same sums in another order)
    return transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_5_moe_path, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def runner(tiny_qwen3_5_moe_path):
    return ModelRunner(tiny_qwen3_5_moe_path, device=CPU, dtype=torch.float32, num_pages=256, page_size=4,
                       attention_backend="sdpa", num_state_slots=4)


@pytest.fixture(scope="module")
def prompts(tiny_qwen3_5_moe_path):
    """A short and a long (> 64 tokens: past a delta-rule chunk) chat prompt's ids."""
    proc = transformers.AutoProcessor.from_pretrained(tiny_qwen3_5_moe_path)
    out = []
    for text in ("Describe this image.", "Tell me a story about the picture. " * 10):
        chat = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                        add_generation_prompt=True, tokenize=False)
        out.append(proc(text=[chat], return_tensors="pt")["input_ids"][0])
    return out


def test_config_and_model(hf_moe, runner):
    c, text = runner.config, hf_moe.config.text_config
    assert (c.model_type, c.is_hybrid, c.intermediate_size) == ("qwen3_5_moe", True, 0)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size, text.shared_expert_intermediate_size)
    assert all(isinstance(layer.mlp, SharedExpertMoeBlock) for layer in runner.model.layers)
    assert runner.kv_pool.num_layers == 1 and runner.state_pool.layers == 3


@torch.no_grad()
def test_block_equals_transformers_bitwise(hf_moe, tiny_qwen3_5_moe_path):
    """Layer 2's block with the checkpoint's weights on random activations: routed experts plus the sigmoid-gated
    shared expert, in transformers' order."""
    hf_block = hf_moe.model.language_model.layers[2].mlp
    block = SharedExpertMoeBlock(ModelConfig.load(tiny_qwen3_5_moe_path), TPGroup.single())
    block.gate.weight.copy_(hf_block.gate.weight)
    block.experts.gate_up_proj.copy_(hf_block.experts.gate_up_proj)
    block.experts.down_proj.copy_(hf_block.experts.down_proj)
    block.shared_expert.gate_up_proj.weight.copy_(torch.cat([hf_block.shared_expert.gate_proj.weight,
                                                             hf_block.shared_expert.up_proj.weight]))
    block.shared_expert.down_proj.weight.copy_(hf_block.shared_expert.down_proj.weight)
    block.shared_expert_gate.weight.copy_(hf_block.shared_expert_gate.weight)
    x = torch.randn(45, hf_moe.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = hf_block(x[None])[0]
    assert torch.equal(block(x), want)
    for m in ("grouped", "gathered"):
        block.experts.method = m
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)


def test_per_expert_checkpoint_loads_the_same_model(hf_moe, tmp_path, runner):
    """``save_pretrained`` writes one tensor per expert: :func:`fuse_per_expert` stacks them into exactly the
    in-memory experts of transformers (gate rows, then up rows), and the runner loads that layout too."""
    import shutil
    from pathlib import Path

    from safetensors import safe_open

    for f in Path(runner.config.model_path).iterdir():  # config, tokenizer, processor
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path)
    # A model loaded from fused tensors saves them fused: save a freshly built one (transformers' own layout).
    fresh = transformers.Qwen3_5MoeForConditionalGeneration(hf_moe.config)
    fresh.load_state_dict(hf_moe.state_dict())
    fresh.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)  # per expert
        fused = dict(fuse_per_expert(((n, f.get_tensor(n)) for n in names), runner.config.num_experts))
    hf_layer = hf_moe.model.language_model.layers[0].mlp.experts
    assert torch.equal(fused["model.language_model.layers.0.mlp.experts.gate_up_proj"], hf_layer.gate_up_proj)
    assert torch.equal(fused["model.language_model.layers.0.mlp.experts.down_proj"], hf_layer.down_proj)
    other = ModelRunner(str(tmp_path), device=CPU, dtype=torch.float32, num_pages=8, page_size=4,
                        attention_backend="sdpa", num_state_slots=1)
    for (name, a), (_, b) in zip(runner.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(a, b), name


def test_fuse_per_expert_rejects_missing_and_foreign_experts():
    one = [("layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(4, 8)),
           ("layers.0.mlp.experts.0.up_proj.weight", torch.zeros(4, 8))]
    with pytest.raises(ValueError, match="lacks per-expert"):
        list(fuse_per_expert(one, 2))
    with pytest.raises(ValueError, match="expert 2 of a model with 2"):
        list(fuse_per_expert([("layers.0.mlp.experts.2.down_proj.weight", torch.zeros(8, 4))], 2))
    fused = dict(fuse_per_expert(one + [("norm.weight", torch.ones(8))], 1))
    assert fused["layers.0.mlp.experts.gate_up_proj"].shape == (1, 8, 8) and "norm.weight" in fused


def test_prefill_logits_and_greedy_decode_equal_transformers(hf_moe, runner, prompts):
    assert_prefill_and_greedy_equal_transformers(hf_moe, runner, prompts)


def test_two_requests_in_one_batch_equal_each_alone(runner, prompts):
    assert_batch_equals_each_alone(runner, prompts)
