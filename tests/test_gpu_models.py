"""The GPU tests' shallow checkpoints (tests/gpu_models.py), checked on the CPU: a copy keeps the first layers of
the source byte for byte and everything else whole, and the model runner and transformers both load it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from epdserve.engine.model_runner import ModelRunner
from epdserve.models.weights import checkpoint_files, lm_name
from gpu_models import gpu_model_ids, shallow_copy


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_shallow_copy_keeps_the_first_layers_and_everything_else(tiny_model_path, tmp_path):
    dst = shallow_copy(tiny_model_path, tmp_path / "one", 1)
    src_t, dst_t = _tensors(tiny_model_path), _tensors(dst)
    dropped = {k for k in src_t if (lm_name(k) or "").startswith("layers.1.")}
    assert dropped and set(dst_t) == set(src_t) - dropped  # the vision tower, embeddings and head stay
    assert all(torch.equal(dst_t[k], src_t[k]) for k in dst_t)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 1
    runner = ModelRunner(str(dst), device=torch.device("cpu"), dtype=torch.float32, num_pages=8, page_size=4)
    assert runner.config.num_layers == 1 and len(runner.model.layers) == 1
    from transformers import AutoModelForImageTextToText, AutoProcessor

    assert AutoModelForImageTextToText.from_pretrained(str(dst)).config.text_config.num_hidden_layers == 1
    AutoProcessor.from_pretrained(str(dst))  # the tokenizer and processor files came along


def test_shallow_copy_of_a_hybrid_model_keeps_an_attention_layer(tiny_qwen3_5_path, tmp_path):
    # The tiny Qwen3.5 is DeltaNet, DeltaNet, attention, DeltaNet.
    with pytest.raises(ValueError, match="no attention layer"):
        shallow_copy(tiny_qwen3_5_path, tmp_path / "two", 2)
    dst = shallow_copy(tiny_qwen3_5_path, tmp_path / "three", 3)
    runner = ModelRunner(str(dst), device=torch.device("cpu"), dtype=torch.float32, num_pages=8, page_size=4)
    assert runner.config.layer_types == ("linear_attention", "linear_attention", "full_attention")
    assert runner.config.num_kv_layers == 1
    with pytest.raises(ValueError, match="keep 1 .. 3"):
        shallow_copy(tiny_qwen3_5_path, tmp_path / "four", 4)


def test_gpu_model_ids_name_the_depth(tiny_model_path, monkeypatch):
    monkeypatch.setenv("EPDSERVE_GPU_TEST_MODELS", tiny_model_path)
    monkeypatch.setenv("EPDSERVE_GPU_TEST_LAYERS", "1")
    name = tiny_model_path.rstrip("/").rsplit("/", 1)[-1]
    assert gpu_model_ids() == ["small-qwen2.5-vl", "small-qwen3-vl", f"{name}-1layers"]
    monkeypatch.setenv("EPDSERVE_GPU_TEST_LAYERS", "4")  # not fewer than the tiny model's 2: used whole
    assert gpu_model_ids()[-1] == name
    monkeypatch.setenv("EPDSERVE_GPU_TEST_LAYERS", "0")
    assert gpu_model_ids()[-1] == name
