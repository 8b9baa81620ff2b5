"""Qwen3.5-MoE checkpoints epdserve writes: the tiny test model (``make-tiny-model --arch qwen3.5-moe``) keeps the
released 35B-A3B ratios, the ``qwen3.5-35b-a3b`` preset has the released shapes (checked on the meta device, with the
step bench's roofline helpers on epdserve's own LM), and, scaled down, loads in transformers and epdserve with equal
prefill logits.

The released counts: "Qwen/Qwen3.5-35B-A3B (35B total/3B active)" (transformers' ``qwen3_5_moe`` model page)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from epdserve.models.presets import PRESETS, make_preset_model

pytest.importorskip("transformers")
RELEASED_TOTAL, RELEASED_ACTIVE = 35e9, 3e9


def test_tiny_keeps_the_released_ratios(tiny_qwen3_5_moe_path):
    from epdserve.models.config import ModelConfig

    tiny, real = ModelConfig.load(tiny_qwen3_5_moe_path), PRESETS["qwen3.5-35b-a3b"]["text"]
    assert tiny.model_type == "qwen3_5_moe"
    assert tiny.num_heads // tiny.num_kv_heads == real["num_attention_heads"] // real["num_key_value_heads"]
    assert tiny.num_heads * tiny.head_dim * real["hidden_size"] == \
        real["num_attention_heads"] * real["head_dim"] * tiny.hidden_size
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(tiny, key) * real["hidden_size"] == real[key] * tiny.hidden_size
    cfg = json.loads((Path(tiny_qwen3_5_moe_path) / "config.json").read_text())["text_config"]
    assert cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"] == \
        real["linear_num_value_heads"] // real["linear_num_key_heads"]
    assert cfg["tie_word_embeddings"] is False


def _epdserve_lm(config, tmp_path):
    """epdserve's reading of ``config`` (written as config.json) and its language model on the meta device."""
    from epdserve.engine.distributed import TPGroup
    from epdserve.models import language_model_class
    from epdserve.models.config import ModelConfig

    config.save_pretrained(tmp_path)
    cfg = ModelConfig.load(str(tmp_path))
    with torch.device("meta"):
        return cfg, language_model_class(cfg)(cfg, tp=TPGroup.single())


def test_preset_real_shapes_without_weights(tmp_path):
    """The whole 35B-A3B on the meta device: language-model parameters within 3 % of the released 35B total and,
    per token (8 of 256 experts, the shared expert, the rest of the LM; not the input embedding lookup), of the 3B
    active; 30 DeltaNet + 10 attention layers, every MLP sparse with a shared expert; the 27-block tower projecting
    to 2048. epdserve's LM has the same parameters, and the step bench's ``lm_params`` / ``active_weights`` count
    the routed experts alone in the share the tokens reach."""
    from epdserve.bench.step import active_weights, expected_experts, lm_params
    from epdserve.models.checkpoint_parts import build_tokenizer
    from epdserve.models.presets import _preset_config

    config, model_cls, _ = _preset_config(PRESETS["qwen3.5-35b-a3b"], build_tokenizer(), {})
    text = config.text_config
    with torch.device("meta"):
        model = model_cls(config)
    lm_model = model.model.language_model
    lm = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.model.visual.parameters())
    E, k = text.num_experts, text.num_experts_per_tok
    routed = sum(p.numel() for n, p in lm_model.named_parameters() if ".experts." in n)
    active = lm - routed * (E - k) / E - lm_model.embed_tokens.weight.numel()
    assert abs(lm / RELEASED_TOTAL - 1) < 0.03 and abs(active / RELEASED_ACTIVE - 1) < 0.03, (lm, active)
    assert text.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 10
    assert all(type(layer.mlp).__name__ == "Qwen3_5MoeSparseMoeBlock" for layer in lm_model.layers)
    assert all(layer.mlp.shared_expert.down_proj.in_features == 512 for layer in lm_model.layers)
    assert (config.vision_config.depth, config.vision_config.out_hidden_size) == (27, text.hidden_size)
    assert config.tie_word_embeddings is False and text.rope_parameters["mrope_section"] == [11, 11, 10]

    cfg, ours = _epdserve_lm(config, tmp_path)
    assert (cfg.is_hybrid, len(cfg.attention_layers), cfg.num_experts, cfg.num_experts_per_tok) == (True, 10, E, k)
    assert sum(p.numel() for p in ours.parameters()) == lm
    runner = SimpleNamespace(model=ours, config=cfg)
    assert lm_params(runner) == pytest.approx(active)
    shares = active_weights(runner, 64)
    assert sum(p.numel() for p, share in shares if share != 1.0) == routed  # the shared expert counts in full
    assert {share for _, share in shares} == {1.0, expected_experts(E, k, 64) / E}


def test_preset_scaled_down_loads_and_matches_transformers(tmp_path):
    """4 layers (3 DeltaNet + 1 attention) of width 256, 16 experts top-8 of 96 and a shared expert of 96, the
    released head dims, DeltaNet heads and vocabulary: experts written fused in the released (in-memory) layout, the
    init rules of Qwen3.5-MoE's own modules, transformers loads every tensor, epdserve's float32 prefill logits equal
    transformers' within 1e-4."""
    from test_presets import _prefill_equals_transformers, _tensors
    from transformers import Qwen3_5MoeForConditionalGeneration

    small = {"text": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                      "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 16,
                      "moe_intermediate_size": 96, "shared_expert_intermediate_size": 96},
             "vision": {"depth": 1}}
    path = make_preset_model(tmp_path / "q35-moe", "qwen3.5-35b-a3b", overrides=small)
    tensors = _tensors(path)
    layer = "model.language_model.layers.0."
    assert tensors[layer + "mlp.experts.gate_up_proj"].shape == (16, 2 * 96, 256)  # released: [E, 2I, hidden]
    assert tensors[layer + "mlp.experts.down_proj"].shape == (16, 256, 96)
    assert tensors[layer + "mlp.experts.gate_up_proj"].float().std().item() == pytest.approx(0.02, rel=0.05)
    assert not any(".experts.0." in name for name in tensors)
    assert (tensors[layer + "input_layernorm.weight"] == 0).all()  # Qwen3_5MoeRMSNorm: zero-centred
    assert (tensors[layer + "linear_attn.dt_bias"] == 1).all()
    runner = _prefill_equals_transformers(path, Qwen3_5MoeForConditionalGeneration)
    assert runner.config.model_type == "qwen3_5_moe" and runner.config.num_experts_per_tok == 8
