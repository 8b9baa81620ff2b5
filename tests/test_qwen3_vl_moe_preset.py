"""Qwen3-VL-MoE checkpoints epdserve writes: the tiny test model (``make-tiny-model --arch qwen3-vl-moe``) keeps the
released 30B-A3B ratios, and the ``qwen3-vl-30b-a3b`` preset has the released shapes (checked on the meta device)
and, scaled down, loads in transformers and epdserve with equal prefill logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from epdserve.models.presets import PRESETS, make_preset_model

pytest.importorskip("transformers")


def test_tiny_keeps_the_released_ratios(tiny_qwen3_vl_moe_path):
    from epdserve.models.config import ModelConfig

    tiny, real = ModelConfig.load(tiny_qwen3_vl_moe_path), PRESETS["qwen3-vl-30b-a3b"]["text"]
    assert tiny.model_type == "qwen3_vl_moe"
    assert tiny.num_heads // tiny.num_kv_heads == real["num_attention_heads"] // real["num_key_value_heads"] == 8
    assert tiny.num_heads * tiny.head_dim == 2 * tiny.hidden_size  # 32 x 128 over 2048
    assert tiny.num_experts // tiny.num_experts_per_tok == real["num_experts"] // real["num_experts_per_tok"]
    assert tiny.moe_intermediate_size * 2048 == 768 * tiny.hidden_size
    assert (tiny.decoder_sparse_step, tiny.mlp_only_layers, tiny.tie_word_embeddings) == (1, (), False)
    cfg = json.loads((Path(tiny_qwen3_vl_moe_path) / "config.json").read_text())
    assert "shared_expert_intermediate_size" not in cfg["text_config"]


def test_preset_real_shapes_without_weights():
    """The whole 30B-A3B on the meta device: 30.5B language-model parameters of which 3.3B active per token (the
    released model card's counts), a 27-block tower projecting to the text width, every layer sparse."""
    from epdserve.models.checkpoint_parts import build_tokenizer
    from epdserve.models.presets import _preset_config

    config, model_cls, _ = _preset_config(PRESETS["qwen3-vl-30b-a3b"], build_tokenizer(), {})
    text = config.text_config
    with torch.device("meta"):
        model = model_cls(config)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    lm = sum(p.numel() for p in model.parameters()) - vision
    idle = text.num_hidden_layers * (text.num_experts - text.num_experts_per_tok) * 3 * 768 * 2048
    assert 30.4e9 < lm < 30.6e9 and 3.3e9 < lm - idle < 3.4e9
    assert config.vision_config.out_hidden_size == 2048 and config.vision_config.depth == 27
    layers = model.model.language_model.layers
    assert all(type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock" for layer in layers)
    assert not any("shared" in name for name, _ in model.named_parameters())


def test_preset_scaled_down_loads_and_matches_transformers(tmp_path):
    """Two layers of width 256, 16 experts top-8 of 96, the released head dim, vocabulary and transposed expert
    layout: transformers loads every tensor, epdserve's float32 prefill logits equal transformers' within 1e-4."""
    from safetensors import safe_open
    from test_model_runtime import Seq, make_batch
    from transformers import Qwen3VLMoeForConditionalGeneration

    from epdserve.engine.model_runner import ModelRunner

    small = {"text": {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
                      "num_key_value_heads": 1, "num_experts": 16, "moe_intermediate_size": 96},
             "vision": {"depth": 1, "deepstack_visual_indexes": [0]}}
    path = make_preset_model(tmp_path / "moe", "qwen3-vl-30b-a3b", overrides=small)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    with safe_open(str(path / index[name]), framework="pt") as f:
        assert f.get_slice(name).get_shape() == [16, 256, 2 * 96]  # released: [E, hidden, 2I]
        assert f.get_tensor(name).float().std().item() == pytest.approx(0.02, rel=0.05)
    model, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    runner = ModelRunner(str(path), device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=16,
                         attention_backend="sdpa")
    ids = torch.arange(3, 40)
    logits = runner.forward(make_batch([Seq(ids, [], [0, 1, 2], 16).extend_part(len(ids))]))
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=0)
