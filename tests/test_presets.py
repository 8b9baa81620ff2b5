"""Real-shape random-weight presets (``make_preset_model``), checked on scaled-down copies (1 layer, 1 block)
so the suite stays fast: loaders of transformers and epdserve, shapes, determinism, readable greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from epdserve.models.presets import PRESETS, make_preset_model
from epdserve.models.checkpoint_parts import SPECIAL_TOKENS

SHRINK = {"text": {"num_hidden_layers": 1}, "vision": {"depth": 1}}


def _visible(text: str) -> bool:
    return bool(text.strip()) and "\ufffd" not in text and all(c.isprintable() or c.isspace() for c in text)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(str(path / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(index)
    return out


@pytest.fixture(scope="module")
def preset3b(tmp_path_factory) -> Path:
    return make_preset_model(tmp_path_factory.mktemp("qwen2.5-vl-3b-1layer"), "qwen2.5-vl-3b", overrides=SHRINK)


@pytest.fixture(scope="module")
def preset2b(tmp_path_factory) -> Path:
    return make_preset_model(tmp_path_factory.mktemp("qwen2-vl-2b-1layer"), "qwen2-vl-2b", overrides=SHRINK)


def _greedy(model_cls, path: Path, steps: int = 16) -> list[int]:
    from transformers import AutoProcessor

    model, info = model_cls.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    processor = AutoProcessor.from_pretrained(path)
    chat = processor.apply_chat_template([{"role": "user", "content": "Describe the picture."}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[chat], return_tensors="pt")
    with torch.no_grad():
        out = model.eval().generate(**inputs, max_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_preset_3b_config_and_transformers_load(preset3b):
    from transformers import AutoConfig, AutoProcessor, Qwen2_5_VLForConditionalGeneration

    spec = PRESETS["qwen2.5-vl-3b"]
    cfg = AutoConfig.from_pretrained(preset3b)
    text, vision = cfg.text_config, cfg.vision_config
    assert cfg.model_type == "qwen2_5_vl" and cfg.tie_word_embeddings is False
    for key, value in spec["text"].items():
        expected = 1 if key == "num_hidden_layers" else value
        assert getattr(text, key) == expected, key
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert text.rms_norm_eps == 1e-6
    for key, value in spec["vision"].items():
        assert getattr(vision, key) == (1 if key == "depth" else value), key
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)
    assert AutoProcessor.from_pretrained(preset3b).tokenizer.chat_template

    ids = _greedy(Qwen2_5_VLForConditionalGeneration, preset3b)
    tok = AutoProcessor.from_pretrained(preset3b).tokenizer
    assert len(ids) == 16  # EOS's head row is 0, so generation runs to the limit
    assert not set(ids) & set(tok.all_special_ids)
    assert all(_visible(tok.decode([i])) for i in ids), [tok.decode([i]) for i in ids]


def test_preset_3b_weights(preset3b):
    from transformers import AutoTokenizer

    tensors = _tensors(preset3b)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    assert head.shape == embed.shape == (151936, 2048)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (11008, 2048)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 128, 2048)
    assert tensors["visual.blocks.0.mlp.gate_proj.weight"].shape == (3420, 1280)
    assert tensors["visual.merger.mlp.2.weight"].shape == (2048, 5120)
    assert not any(k.startswith("visual.blocks.1.") or k.startswith("model.layers.1.") for k in tensors)
    # transformers' init rules: N(0, 0.02) matrices, unit norms, zero biases, zero padding row
    assert abs(tensors["model.layers.0.mlp.up_proj.weight"].float().std().item() - 0.02) < 1e-3
    assert torch.all(tensors["model.layers.0.input_layernorm.weight"] == 1)
    assert torch.all(tensors["model.layers.0.self_attn.q_proj.bias"] == 0)
    assert torch.all(embed[0] == 0) and embed[1].abs().sum() > 0  # <|endoftext|> is the pad id
    # readable output: head rows are 0 exactly for ids that do not decode to visible text
    tok = AutoTokenizer.from_pretrained(preset3b)
    zero = (head == 0).all(dim=1)
    visible = torch.tensor([i < len(tok) and _visible(tok.decode([i], skip_special_tokens=True))
                            for i in range(head.shape[0])])
    assert torch.equal(zero, ~visible)
    assert zero[len(tok):].all() and all(zero[tok.convert_tokens_to_ids(t)] for t in SPECIAL_TOKENS)
    assert int(zero.sum()) > 151936 - len(tok) and int((~zero).sum()) > 200
    note = json.loads((preset3b / "epdserve_preset.json").read_text())
    assert note["preset"] == "qwen2.5-vl-3b" and note["seed"] == 0
    assert note["zeroed_lm_head_rows"] == int(zero.sum())
    assert note["num_parameters"] == sum(t.numel() for t in tensors.values())


def test_preset_3b_epdserve_loaders(preset3b):
    from PIL import Image

    from epdserve.encoder.vision import VisionEncoder
    from epdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(str(preset3b), device=torch.device("cpu"), dtype=torch.bfloat16, num_pages=64, page_size=16)
    c = runner.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        "qwen2_5_vl", 151936, 2048, 11008, 1)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (16, 2, 128, False)
    assert c.max_position_embeddings == 128000 and tuple(c.mrope_section) == (16, 24, 24)
    enc = VisionEncoder(preset3b, torch.device("cpu"), torch.bfloat16)
    [(emb, grid)] = enc.encode([Image.new("RGB", (112, 84), (200, 40, 40))])
    assert grid == [1, 6, 8] and emb.shape == (12, 2048) and emb.dtype == torch.bfloat16


def test_preset_processor_image_tokens(preset3b):
    """The released processor's pixel bounds: a 1280x720 image is resized to 1288x728, 1196 image tokens."""
    from PIL import Image
    from transformers import AutoProcessor

    ip = AutoProcessor.from_pretrained(preset3b).image_processor
    grid = ip(images=[Image.new("RGB", (1280, 720))], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert grid == [1, 52, 92] and grid[0] * grid[1] * grid[2] // 4 == 1196
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (3136, 12845056)  # min_pixels, max_pixels


def test_preset_tied_2b(preset2b):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from epdserve.engine.model_runner import ModelRunner

    tensors = _tensors(preset2b)
    assert "lm_head.weight" not in tensors  # tied: the embedding is the head
    embed = tensors["model.embed_tokens.weight"]
    assert embed.shape == (151936, 1536)
    assert tensors["visual.blocks.0.mlp.fc1.weight"].shape == (4 * 1280, 1280)
    tok = AutoTokenizer.from_pretrained(preset2b)
    special = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    # prompts' special tokens keep their input embeddings (the pad row is 0 by transformers' init)
    assert all(embed[i].abs().sum() > 0 for i in special if i != pad)
    assert (embed[len(tok):] == 0).all()
    ids = _greedy(Qwen2VLForConditionalGeneration, preset2b)
    assert ids and all(i not in special for i in ids)
    assert all(_visible(tok.decode([i])) for i in ids), [tok.decode([i]) for i in ids]
    runner = ModelRunner(str(preset2b), device=torch.device("cpu"), dtype=torch.bfloat16, num_pages=64, page_size=16)
    assert (runner.config.hidden_size, runner.config.num_heads, runner.config.tie_word_embeddings) == (1536, 12, True)


def test_preset_deterministic(tmp_path):
    small = {"text": {"num_hidden_layers": 1, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
                      "num_attention_heads": 2, "num_key_value_heads": 1},
             "vision": {"depth": 1, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2,
                        "out_hidden_size": 256}}
    a = make_preset_model(tmp_path / "a", "qwen2.5-vl-7b", seed=3, overrides=small)
    b = make_preset_model(tmp_path / "b", "qwen2.5-vl-7b", seed=3, overrides=small)
    c = make_preset_model(tmp_path / "c", "qwen2.5-vl-7b", seed=4, overrides=small)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and "model.safetensors.index.json" in files
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    shard = "model-00001-of-00001.safetensors"
    assert (a / shard).read_bytes() != (c / shard).read_bytes()
    with pytest.raises(ValueError, match="unknown preset"):
        make_preset_model(tmp_path / "d", "qwen3-vl")


def test_cli_preset(tmp_path, monkeypatch, capsys):
    import epdserve.models.presets as presets
    from epdserve.entry.cli import main

    calls = []
    monkeypatch.setattr(presets, "make_preset_model", lambda d, p, **kw: calls.append((d, p, kw)) or Path(d))
    assert main(["make-tiny-model", str(tmp_path), "--preset", "qwen2.5-vl-3b", "--device", "cuda",
                 "--seed", "7"]) == 0
    assert calls == [(str(tmp_path), "qwen2.5-vl-3b", {"seed": 7, "device": "cuda"})]
    assert capsys.readouterr().out.strip() == str(tmp_path)
    for bad in (["--preset", "qwen2-vl-2b", "--size", "small"], ["--preset", "qwen2-vl-2b", "--arch", "qwen2_vl"],
                ["--device", "cuda"], ["--preset", "llava"]):
        with pytest.raises(SystemExit) as e:
            main(["make-tiny-model", str(tmp_path), *bad])
        assert e.value.code == 2


def test_default_model_answers_a_photo_in_readable_text(tmp_path, monkeypatch, photo_paths):
    # What a newcomer sees first (the quickstart serves this model): greedy text about a real photo has no U+FFFD
    # from lone bytes and no invisible characters. The test checkpoints stay unzeroed.
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from epdserve.models.paths import default_model_path

    monkeypatch.setenv("EPDSERVE_CACHE", str(tmp_path))
    path = default_model_path()
    assert path.name == "tiny-qwen2.5-vl-readable" and default_model_path() == path
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[Image.open(photo_paths["chelsea"]).convert("RGB")], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(text.strip()) > 10 and "\ufffd" not in text
    assert all(c.isprintable() or c.isspace() for c in text), repr(text)


def _prefill_equals_transformers(path, model_cls=None):
    """transformers (``model_cls``, default ``Qwen3_5ForConditionalGeneration``) loads the Qwen3.5 checkpoint at
    ``path`` whole, and epdserve's float32 prefill of 37 tokens gives its last logits within 1e-4. Returns
    epdserve's :class:`ModelRunner`."""
    import dataclasses

    from test_model_runtime import Seq, make_batch
    from transformers import Qwen3_5ForConditionalGeneration

    from epdserve.engine.model_runner import ModelRunner

    model, info = (model_cls or Qwen3_5ForConditionalGeneration).from_pretrained(path, dtype=torch.float32,
                                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    runner = ModelRunner(str(path), device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=16,
                         attention_backend="sdpa", num_state_slots=2)
    ids = torch.arange(3, 40)
    seq, slot = Seq(ids, [], [0, 1, 2], 16), runner.state_pool.alloc()
    logits = runner.forward(dataclasses.replace(make_batch([seq.extend_part(len(ids))]), state_slots=[slot]))
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=0)
    return runner

def test_preset_qwen3_5_9b_shapes_init_and_loaders(tmp_path):
    """The Qwen3.5-9B preset's sizes (24 DeltaNet + 8 attention layers; see epdserve.models.presets for the
    sources), its init rules (zero-centred norms 0, dt_bias 1, A_log = log U(0.01, 16)), and a scaled-down copy
    (4 layers, hidden 256, 1 vision block; the real DeltaNet head sizes and vocabulary) that transformers loads
    without missing tensors, epdserve's runner and encoder load, and whose epdserve prefill logits equal
    transformers'."""
    from PIL import Image

    from epdserve.encoder.vision import VisionEncoder
    from epdserve.engine.state_io import state_shapes
    from epdserve.models.config import ModelConfig

    text = PRESETS["qwen3.5-9b"]["text"]
    assert text["layer_types"].count("linear_attention") == 24 and len(text["layer_types"]) == 32
    small = {"text": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                      "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
                      "num_key_value_heads": 1},
             "vision": {"depth": 1}}
    path = make_preset_model(tmp_path / "q35", "qwen3.5-9b", overrides=small)
    cfg = ModelConfig.load(str(path))
    assert (cfg.model_type, cfg.vocab_size, cfg.linear_conv_dim, cfg.head_dim) == ("qwen3_5", 248320, 8192, 256)
    conv, rec = state_shapes(cfg)
    assert conv == (3, 8192, 4) and rec == (3, 32, 128, 128)
    tensors = _tensors(path)
    deltanet = "model.language_model.layers.0.linear_attn."
    assert (tensors[deltanet + "dt_bias"] == 1).all()
    a_log = tensors[deltanet + "A_log"].float()
    assert a_log.min() >= torch.tensor(0.01).log() - 0.01 and a_log.max() <= torch.tensor(16.0).log() + 0.01
    assert a_log.std() > 0.3  # drawn, not constant
    assert (tensors["model.language_model.layers.0.input_layernorm.weight"] == 0).all()
    assert (tensors[deltanet + "norm.weight"] == 1).all()

    _prefill_equals_transformers(path)
    enc = VisionEncoder(path, torch.device("cpu"), torch.bfloat16)
    [(emb, grid)] = enc.encode([Image.new("RGB", (256, 256), (200, 40, 40))])
    assert emb.shape == (grid[0] * grid[1] * grid[2] // 4, 256)


# Released parameter counts where a public source gives one (Qwen3.5-4B: 4.66B, an admission report reading the Hub's
# safetensors metadata; Qwen3.5-27B's architecture: 55.56 GB of bf16 = 27.78B, Qwen3.6-27B's index) include the MTP
# head, which Qwen3_5ForConditionalGeneration does not build; the others are the model names.
QWEN35_PARAMS = {"qwen3.5-0.8b": (0.80e9, 0.90e9), "qwen3.5-4b": (4.40e9, 4.66e9), "qwen3.5-9b": (9.0e9, 9.7e9),
                 "qwen3.5-27b": (26.5e9, 27.78e9)}


@pytest.mark.parametrize("name", sorted(QWEN35_PARAMS))
def test_qwen3_5_presets_real_shapes_without_weights(name):
    """Every Qwen3.5 preset, config-level and on the meta device (no 27B of weights on a CPU runner): the released
    layout (3 DeltaNet : 1 attention, as ``full_attention_interval`` 4 gives: the last layer attention), grouped query
    attention and grouped DeltaNet heads that divide evenly, equal DeltaNet key and value head dims, partial rotary
    0.25 with an mrope_section covering the rotated half, the vision tower projecting to the text width, and a
    parameter count in the released range."""
    from epdserve.models.checkpoint_parts import build_tokenizer
    from epdserve.models.config import ModelConfig
    from epdserve.models.presets import _preset_config

    spec = PRESETS[name]
    config, model_cls, _ = _preset_config(spec, build_tokenizer(), {})
    text, vision = config.text_config, config.vision_config
    layers = text.layer_types
    assert len(layers) == text.num_hidden_layers and text.num_hidden_layers % 4 == 0
    assert layers == (["linear_attention"] * 3 + ["full_attention"]) * (text.num_hidden_layers // 4)
    assert text.num_attention_heads % text.num_key_value_heads == 0
    assert text.linear_num_value_heads % text.linear_num_key_heads == 0
    assert text.linear_key_head_dim == text.linear_value_head_dim == 128 and text.head_dim == 256
    rope = text.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and sum(rope["mrope_section"]) == 256 * 0.25 // 2
    assert rope["rope_theta"] == 1e7 and rope["mrope_interleaved"]
    assert (text.vocab_size, text.max_position_embeddings) == (248320, 262144)
    assert vision.out_hidden_size == text.hidden_size and vision.patch_size == 16
    assert config.tie_word_embeddings is spec["tie_word_embeddings"]
    with torch.device("meta"):
        model = model_cls(config)
    low, high = QWEN35_PARAMS[name]
    assert low <= sum(p.numel() for p in model.parameters()) <= high
    assert hasattr(model, "lm_head") and (model.lm_head.weight is model.model.language_model.embed_tokens.weight) \
        is spec["tie_word_embeddings"]
    # epdserve's own reading of the written config.json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        cfg = ModelConfig.load(tmp)
    assert cfg.attention_layers == tuple(range(3, text.num_hidden_layers, 4))
    assert (cfg.rotary_dim, cfg.tie_word_embeddings) == (64, spec["tie_word_embeddings"])


def test_preset_qwen3_5_tied_small_loads_and_matches_transformers(tmp_path):
    """The tied Qwen3.5 presets (0.8B, 4B) scaled down (4 layers of 256, the 0.8B's ungrouped 16 K / 16 V DeltaNet
    heads and vocabulary, 1 vision block): no lm_head tensor on disk, transformers loads it without missing
    tensors, and epdserve's prefill logits equal transformers'."""
    small = {"text": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                      "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                      "num_key_value_heads": 1},
             "vision": {"depth": 1}}
    path = make_preset_model(tmp_path / "q35-tied", "qwen3.5-0.8b", overrides=small)
    tensors = _tensors(path)
    assert "lm_head.weight" not in tensors
    assert tensors["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (3 * 16 * 128, 256)
    assert _prefill_equals_transformers(path).config.tie_word_embeddings
