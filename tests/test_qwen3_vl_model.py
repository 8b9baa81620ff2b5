"""Qwen3-VL (dense) model pieces against transformers: the vision tower's embeddings and DeepStack levels, M-RoPE
positions, the LM's prefill logits and greedy decoding over the paged KV cache, config loading of both layouts,
and the real-shape presets."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_model_runtime import Pages, Seq, image_spans, make_batch

from epdserve.engine.model_runner import ModelRunner
from epdserve.models.config import ModelConfig
from epdserve.models.mrope import mrope_positions

CPU = torch.device("cpu")


def rows(x) -> torch.Tensor:
    """Image rows ``[N, hidden]`` from one of ``get_image_features``' outputs: a tensor, or split per image."""
    return x if torch.is_tensor(x) else torch.cat(list(x))


# ---------------------------------------------------------------- helpers and fixtures


class Seq3(Seq):
    """A :class:`Seq` whose image rows also carry DeepStack levels ``[L, N, hidden]``, sliced like its
    ``mm_embeds`` for each extend."""

    def __init__(self, ids, images, pages, page_size, mm_embeds=None, deepstack=None, image_token_id=None):
        super().__init__(ids, images, pages, page_size, mm_embeds, image_token_id)
        self.deepstack = deepstack

    def extend_part(self, end):
        before = int(self.mm_mask[:self.cached].sum()) if self.mm_mask is not None else 0
        part = super().extend_part(end)
        if part["mm"] is not None:
            part["ds"] = self.deepstack[:, before:before + int(part["mm"][1].sum())]
        return part


def make_batch3(parts, is_decode=False):
    batch = make_batch(parts, is_decode)
    levels = [p["ds"] for p in parts if p.get("ds") is not None]
    return dataclasses.replace(batch, deepstack_embeds=torch.cat(levels, dim=1) if levels else None)


class HF3:
    """transformers' Qwen3-VL model + processor of the tiny checkpoint, and prompts built with its chat template."""

    def __init__(self, path):
        from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

        self.path = path
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(path)
        self.cfg = ModelConfig.load(path)

    def prompt(self, photos, text="Describe this image."):
        from PIL import Image

        content = [{"type": "image"} for _ in photos] + [{"type": "text", "text": text}]
        chat = self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=False)
        images = [Image.open(p).convert("RGB") for p in photos] or None
        return self.processor(text=[chat], images=images, return_tensors="pt")

    def image_features(self, inputs):
        """transformers' ``get_image_features``: (embeddings ``[N, hidden]``, DeepStack ``[L, N, hidden]``)."""
        with torch.no_grad():
            out = self.model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                      image_grid_thw=inputs["image_grid_thw"])
        # transformers >= 5.18 splits each DeepStack level per image as it does pooler_output; 5.17 keeps one tensor.
        return rows(out.pooler_output), torch.stack([rows(level) for level in out.deepstack_features])

    def seq(self, inputs, pages, page_size, features=None):
        """A :class:`Seq3` of the prompt, its image rows from ``features`` (``(embeds, deepstack)``; default:
        transformers' own)."""
        ids = inputs["input_ids"][0]
        if "pixel_values" not in inputs:
            return Seq3(ids, [], pages, page_size)
        spans = image_spans(ids, inputs["image_grid_thw"], self.cfg.image_token_id)
        embeds, deepstack = features or self.image_features(inputs)
        return Seq3(ids, spans, pages, page_size, embeds, deepstack, self.cfg.image_token_id)


@pytest.fixture(scope="module")
def hf3(tiny_qwen3_vl_path):
    return HF3(tiny_qwen3_vl_path)


@pytest.fixture(scope="module")
def encoder3(tiny_qwen3_vl_path):
    from epdserve.encoder.vision import VisionEncoder

    return VisionEncoder(tiny_qwen3_vl_path, "cpu", "float32")


@pytest.fixture(scope="module")
def runner3(tiny_qwen3_vl_path):
    return ModelRunner(tiny_qwen3_vl_path, device=CPU, dtype=torch.float32, num_pages=1024, page_size=16,
                       attention_backend="sdpa")


def ours(encoder, photos):
    """Our encoder's features of ``photos`` (one batch), concatenated as the LM takes them."""
    from PIL import Image

    out = torch.cat([emb for emb, _ in encoder.encode([Image.open(p).convert("RGB") for p in photos])])
    hidden = encoder.hidden_size
    return out[:, :hidden], out[:, hidden:].unflatten(-1, (-1, hidden)).transpose(0, 1)


# ---------------------------------------------------------------- the tiny checkpoint and its config


def test_tiny_checkpoint_config_and_processor(hf3, tiny_qwen3_vl_path):
    c, text, vision = hf3.cfg, hf3.model.config.text_config, hf3.model.config.vision_config
    assert c.model_type == "qwen3_vl" and c.mrope_interleaved
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
        text.intermediate_size)
    assert c.head_dim == text.head_dim != c.hidden_size // c.num_heads  # the tiny model exercises the difference
    assert list(c.mrope_section) == text.rope_parameters["mrope_section"]
    assert c.rope_theta == text.rope_parameters["rope_theta"] and c.vocab_size == text.vocab_size
    assert c.deepstack_visual_indexes == tuple(vision.deepstack_visual_indexes) and c.num_deepstack_layers >= 2
    assert c.num_deepstack_layers < c.num_layers  # some decoder layers take no DeepStack level
    assert c.image_token_id == hf3.model.config.image_token_id and c.spatial_merge_size == 2
    assert vision.patch_size == hf3.processor.image_processor.patch_size == 16
    assert type(hf3.processor).__name__ == "Qwen3VLProcessor"
    assert type(hf3.processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    chat = hf3.processor.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # Qwen3-VL adds no system prompt


# ---------------------------------------------------------------- encoder


@pytest.mark.parametrize("names", [["chelsea"], ["rocket", "page"]])
def test_encoder_matches_get_image_features(hf3, encoder3, photo_paths, names):
    inputs = hf3.prompt([photo_paths[n] for n in names])
    ref_embeds, ref_levels = hf3.image_features(inputs)
    from PIL import Image

    out = encoder3.encode([Image.open(photo_paths[n]).convert("RGB") for n in names])
    assert [grid for _, grid in out] == inputs["image_grid_thw"].tolist()
    assert encoder3.num_deepstack == ref_levels.shape[0] == hf3.cfg.num_deepstack_layers
    assert encoder3.embed_width == hf3.cfg.embed_width == hf3.cfg.hidden_size * (1 + encoder3.num_deepstack)
    for emb, grid in out:  # the DeepStack levels travel as extra columns of every image row
        assert emb.shape == (encoder3.num_tokens(grid), encoder3.embed_width) and emb.is_contiguous()
    embeds, levels = ours(encoder3, [photo_paths[n] for n in names])
    torch.testing.assert_close(embeds, ref_embeds, atol=1e-5, rtol=1e-5)
    for level, ref in zip(levels, ref_levels):
        torch.testing.assert_close(level, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- M-RoPE


@pytest.mark.parametrize("names", [[], ["chelsea"], ["rocket", "camera"]])
def test_mrope_matches_transformers(hf3, photo_paths, names):
    inputs = hf3.prompt([photo_paths[n] for n in names])
    ids = inputs["input_ids"]
    spans = image_spans(ids[0], inputs["image_grid_thw"], hf3.cfg.image_token_id) if names else []
    pos, delta = mrope_positions(ids.shape[1], spans, hf3.cfg.spatial_merge_size)
    if not names:
        assert torch.equal(pos, torch.arange(ids.shape[1]).expand(3, -1)) and delta == 0
        return
    ref, ref_delta = hf3.model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert torch.equal(pos, ref[:, 0]) and delta == int(ref_delta)


# ---------------------------------------------------------------- LM parity


def greedy(runner, seq, steps):
    """Prefill ``seq`` then decode greedily; returns (prefill logits [V], tokens [steps])."""
    first = runner.forward(make_batch3([seq.extend_part(len(seq.ids))]))[0]
    tokens = [int(first.argmax())]
    for _ in range(steps - 1):
        logits = runner.forward(make_batch3([seq.decode_part(tokens[-1])], is_decode=True))
        tokens.append(int(logits[0].argmax()))
    return first, tokens


@pytest.mark.parametrize("photos,page_size", [([], 16), (["chelsea"], 16), (["coffee"], 7)])
def test_logits_and_greedy_match_transformers(hf3, encoder3, photo_paths, photos, page_size):
    paths = [photo_paths[p] for p in photos]
    inputs = hf3.prompt(paths)
    n, steps = inputs["input_ids"].shape[1], 9
    if page_size != 16:
        assert n % page_size, "the page size must not divide the prompt length"
    runner = ModelRunner(hf3.path, device=CPU, dtype=torch.float32, num_pages=256, page_size=page_size,
                         attention_backend="sdpa")
    features = ours(encoder3, paths) if photos else None  # our encoder feeds our LM
    seq = hf3.seq(inputs, Pages(256, seed=page_size).take(-(-(n + steps) // page_size)), page_size, features)
    first, tokens = greedy(runner, seq, steps)
    with torch.no_grad():
        ref_logits = hf3.model(**inputs).logits[0, -1]
        ref = hf3.model.generate(**inputs, max_new_tokens=steps, do_sample=False)[0, n:].tolist()
    torch.testing.assert_close(first, ref_logits, atol=1e-4, rtol=1e-4)
    assert len(ref) >= 1
    assert tokens[:len(ref)] == ref  # generate may stop early at an eos


def test_deepstack_changes_the_answer(hf3, runner3, photo_paths):
    """The DeepStack rows reach the logits: zeroing them moves the prefill logits (the parity test above would
    not notice a model that ignores a feature transformers also ignored)."""
    inputs = hf3.prompt([photo_paths["chelsea"]])
    n, ps = inputs["input_ids"].shape[1], runner3.page_size
    pages = Pages(runner3.num_pages, seed=5)
    real, zeroed = (hf3.seq(inputs, pages.take(-(-n // ps)), ps) for _ in range(2))
    zeroed.deepstack = torch.zeros_like(zeroed.deepstack)
    a = runner3.forward(make_batch3([real.extend_part(n)]))
    b = runner3.forward(make_batch3([zeroed.extend_part(n)]))
    assert (a - b).abs().max() > 1e-3


def test_deepstack_as_embedding_columns_is_the_same_forward(hf3, runner3, photo_paths):
    """The encoder's wire layout (``mm_embeds`` ``[N, hidden * (1 + L)]``, no ``deepstack_embeds``) computes what
    the explicit levels do."""
    inputs = hf3.prompt([photo_paths["rocket"]])
    n, ps = inputs["input_ids"].shape[1], runner3.page_size
    pages = Pages(runner3.num_pages, seed=7)
    a_seq, b_seq = (hf3.seq(inputs, pages.take(-(-n // ps)), ps) for _ in range(2))
    explicit = make_batch3([a_seq.extend_part(n)])
    cols = torch.cat([explicit.mm_embeds, *explicit.deepstack_embeds], dim=-1)
    wire = dataclasses.replace(make_batch3([b_seq.extend_part(n)]), mm_embeds=cols, deepstack_embeds=None)
    assert cols.shape[1] == hf3.cfg.embed_width
    torch.testing.assert_close(runner3.forward(wire), runner3.forward(explicit), atol=0, rtol=0)


def test_prefix_reuse_and_aligned_rows_match_one_shot(hf3, runner3, photo_paths):
    """An extend that starts inside the image (cached prefix) and the graph-safe aligned form of the image and
    DeepStack rows compute what one packed prefill does."""
    inputs = hf3.prompt([photo_paths["astronaut"]])
    n, ps = inputs["input_ids"].shape[1], runner3.page_size
    pages = Pages(runner3.num_pages, seed=6)
    one = hf3.seq(inputs, pages.take(-(-n // ps)), ps)
    ref = runner3.forward(make_batch3([one.extend_part(n)]))
    two, aligned = (hf3.seq(inputs, pages.take(-(-n // ps)), ps) for _ in range(2))
    split = int(two.mm_mask.nonzero()[0]) + 5  # five image rows in the first part
    runner3.forward(make_batch3([two.extend_part(split)]))
    torch.testing.assert_close(runner3.forward(make_batch3([two.extend_part(n)])), ref, atol=1e-5, rtol=1e-5)

    batch = make_batch3([aligned.extend_part(n)])
    mask, t = batch.mm_mask, batch.input_ids.shape[0]
    rows = torch.full((t, batch.mm_embeds.shape[1]), float("nan"))  # rows outside the mask must not leak in
    rows[mask] = batch.mm_embeds
    levels = torch.full((batch.deepstack_embeds.shape[0], t, rows.shape[1]), float("nan"))
    levels[:, mask] = batch.deepstack_embeds
    batch = dataclasses.replace(batch, mm_embeds=rows, deepstack_embeds=levels, last_rows=torch.tensor([t - 1]))
    assert torch.equal(runner3.forward(batch), ref)


def test_image_rows_without_deepstack_are_refused(hf3, runner3, photo_paths):
    inputs = hf3.prompt([photo_paths["coffee"]])
    n, ps = inputs["input_ids"].shape[1], runner3.page_size
    batch = make_batch3([hf3.seq(inputs, Pages(runner3.num_pages, seed=7).take(-(-n // ps)), ps).extend_part(n)])
    with pytest.raises(ValueError, match="deepstack_embeds"):
        runner3.forward(dataclasses.replace(batch, deepstack_embeds=None))
    with pytest.raises(ValueError, match="deepstack_embeds"):
        runner3.forward(dataclasses.replace(batch, deepstack_embeds=batch.deepstack_embeds[:, 1:]))


# ---------------------------------------------------------------- config layouts


# The released Qwen/Qwen3-VL-2B-Instruct config.json (transformers 4.57.0.dev0 layout), keys as published.
HUB_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": True, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652,
}


def test_config_hub_layout_matches_transformers(tmp_path):
    """The hub layout and the transformers-5 layout that ``save_pretrained`` makes of it load to the same
    ModelConfig, with transformers' own reading of the shapes."""
    from transformers import AutoConfig

    hub, new = tmp_path / "hub", tmp_path / "new"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps(HUB_2B))
    (hub / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    ref = AutoConfig.from_pretrained(hub)
    ref.save_pretrained(new)
    assert "rope_parameters" in json.loads((new / "config.json").read_text())["text_config"]
    (new / "generation_config.json").write_text((hub / "generation_config.json").read_text())
    a, b = ModelConfig.load(hub), ModelConfig.load(new)
    assert dataclasses.replace(a, model_path="") == dataclasses.replace(b, model_path="")
    t = ref.text_config
    assert (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size) == (
        t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
        t.intermediate_size)
    assert a.rope_theta == t.rope_parameters["rope_theta"] and list(a.mrope_section) == t.rope_parameters[
        "mrope_section"]
    assert a.mrope_interleaved and a.deepstack_visual_indexes == tuple(ref.vision_config.deepstack_visual_indexes)
    assert a.tie_word_embeddings == ref.tie_word_embeddings and a.vocab_size == t.vocab_size
    assert a.max_position_embeddings == t.max_position_embeddings and a.eos_token_ids == (151643, 151645)
    assert (a.image_token_id, a.video_token_id, a.vision_start_token_id, a.vision_end_token_id) == (
        ref.image_token_id, ref.video_token_id, ref.vision_start_token_id, ref.vision_end_token_id)

    bad = json.loads(json.dumps(HUB_2B))
    bad["text_config"]["rope_scaling"]["mrope_section"] = [24, 20, 24]
    (hub / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="mrope_section"):
        ModelConfig.load(hub)


def test_qwen2_configs_keep_their_values(tiny_model_path, tiny_qwen2_vl_path):
    for path in (tiny_model_path, tiny_qwen2_vl_path):
        c = ModelConfig.load(path)
        assert not c.mrope_interleaved and c.deepstack_visual_indexes == () and c.num_deepstack_layers == 0
        assert c.head_dim == c.hidden_size // c.num_heads


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("preset", ["qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b"])
def test_preset_shapes_on_meta(preset):
    """Each preset's transformers model (built on the meta device) against the preset table and our LM's
    config reading; the 8B against the released checkpoint's parameter count."""
    from epdserve.models.presets import PRESETS, _preset_config, _tensor_plan
    from epdserve.models.checkpoint_parts import build_tokenizer

    spec = PRESETS[preset]
    config, model_cls, _ = _preset_config(spec, build_tokenizer(), {})
    with torch.device("meta"):
        model = model_cls(config)
    text, vision = config.text_config, config.vision_config
    for key, value in spec["text"].items():
        got = text.rope_parameters[key] if key == "mrope_section" else getattr(text, key)
        assert got == value, key
    for key, value in spec["vision"].items():
        assert getattr(vision, key) == value, key
    assert vision.out_hidden_size == text.hidden_size and vision.patch_size == 16
    attn = model.model.language_model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (text.num_attention_heads * 128, text.hidden_size) and attn.q_proj.bias is None
    assert attn.q_norm.weight.shape == (128,)
    assert len(model.model.visual.deepstack_merger_list) == len(spec["vision"]["deepstack_visual_indexes"])
    assert config.tie_word_embeddings == spec["tie_word_embeddings"]
    if preset == "qwen3-vl-8b":  # the released safetensors hold 750 tensors, 8,767,123,696 parameters
        plan = _tensor_plan(model)
        assert len(plan) == 750
        assert sum(torch.Size(shape).numel() for _, _, shape, *_ in plan) == 8_767_123_696


def test_preset_2b_checkpoint(tmp_path):
    """A scaled-down qwen3-vl-2b (1 layer, 1 block, DeepStack from that block) loads in transformers, in our
    ModelRunner and VisionEncoder, with the real widths."""
    from PIL import Image
    from safetensors import safe_open
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from epdserve.encoder.vision import VisionEncoder
    from epdserve.models.presets import make_preset_model

    path = make_preset_model(tmp_path, "qwen3-vl-2b", overrides={
        "text": {"num_hidden_layers": 1}, "vision": {"depth": 1, "deepstack_visual_indexes": [0]}})
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index  # tied
    with safe_open(str(path / index["model.language_model.layers.0.self_attn.k_proj.weight"]), "pt") as f:
        assert f.get_slice("model.language_model.layers.0.self_attn.k_proj.weight").get_shape() == [8 * 128, 2048]
    _, info = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ip = AutoProcessor.from_pretrained(path).image_processor
    assert (ip.size["shortest_edge"], ip.size["longest_edge"], ip.patch_size) == (65536, 16777216, 16)
    runner = ModelRunner(str(path), device=CPU, dtype=torch.bfloat16, num_pages=8, page_size=16)
    c = runner.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (2048, 16, 8, 128, 6144)
    assert c.tie_word_embeddings and c.mrope_section == (24, 20, 20) and c.rope_theta == 5e6
    assert runner.model.lm_head.weight.data_ptr() == runner.model.embed_tokens.weight.data_ptr()
    enc = VisionEncoder(path, CPU, torch.bfloat16)
    [(emb, grid)] = enc.encode([Image.new("RGB", (320, 256), (200, 40, 40))])
    assert grid == [1, 16, 20] and emb.shape == (80, 2048 * 2)  # one DeepStack level as extra columns
