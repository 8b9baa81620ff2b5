"""Qwen3-VL-MoE's sparse block against transformers: the router's top-k selection and weights, the block's output
from the released checkpoint layout (what ``save_pretrained`` writes), and TP=2 shards summing to the TP=1 output."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from epdserve.engine.distributed import TPGroup
from epdserve.models.qwen3_vl_moe_lm import Experts, SparseMoeBlock, route

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf_moe  # noqa: E402

# The released 30B-A3B ratios shrunk: 128 experts top-8 -> 16 top-4; hidden 2048 : moe_intermediate 768.
HIDDEN, EXPERTS, TOP_K, INTER = 64, 16, 4, 24


def _text_config():
    return transformers.Qwen3VLMoeTextConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                              moe_intermediate_size=INTER, hidden_act="silu")


@pytest.fixture(scope="module")
def hf_block():
    """transformers' sparse block with random float32 weights (fixed seed)."""
    torch.manual_seed(0)
    block = hf_moe.Qwen3VLMoeTextSparseMoeBlock(_text_config()).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block


def _ours(hf_block, tp: TPGroup, hub_layout: bool = True) -> SparseMoeBlock:
    """Our block loaded from the released hub layout (the transposes of transformers' in-memory tensors) or from
    what ``save_pretrained`` writes (the in-memory tensors)."""
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, tp)
    block.gate.weight.data.copy_(hf_block.gate.weight)
    exp = block.experts
    for name in ("gate_up_proj", "down_proj"):
        t = getattr(hf_block.experts, name).detach()
        exp.load_shard(getattr(exp, name), t.transpose(1, 2).contiguous() if hub_layout else t.clone())
    return block


def test_router_matches_transformers(hf_block):
    torch.manual_seed(1)
    x = torch.randn(57, HIDDEN)
    _, hf_weights, hf_experts = hf_block.gate(x)
    weights, experts = route(x, hf_block.gate.weight.detach(), TOP_K)
    assert torch.equal(experts, hf_experts)
    assert torch.equal(weights, hf_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(57))
    assert len(torch.unique(experts)) > TOP_K  # routing really picks different subsets


@torch.no_grad()
def test_block_matches_transformers_bitwise(hf_block):
    torch.manual_seed(2)
    x = torch.randn(33, HIDDEN)
    want = hf_block(x[None])[0]
    for hub_layout in (True, False):
        assert torch.equal(_ours(hf_block, TPGroup.single(), hub_layout)(x), want)


@torch.no_grad()
def test_tp2_shards_sum_to_the_full_block(hf_block):
    torch.manual_seed(3)
    x = torch.randn(21, HIDDEN)
    full = _ours(hf_block, TPGroup.single())(x)
    # Each rank's partial sum (what it all-reduces); TPGroup of size 2 without a process group, so call experts.
    parts = []
    for rank in range(2):
        block = _ours(hf_block, TPGroup(rank, 2, torch.device("cpu")))
        assert block.experts.gate_up_proj.shape == (EXPERTS, INTER, HIDDEN)
        parts.append(block.experts(x, *route(x, block.gate.weight, TOP_K)))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)


def test_save_pretrained_writes_the_in_memory_expert_layout(tmp_path):
    """transformers 5's ``save_pretrained`` writes the in-memory layout (``gate_up_proj`` ``[E, 2I, hidden]``,
    ``down_proj`` ``[E, hidden, I]``), not the released checkpoint's transposes: the loader must take both."""
    cfg = transformers.Qwen3VLMoeConfig(
        text_config=dict(_text_config().to_dict(), num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=128, intermediate_size=48,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 5, 5],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                           deepstack_visual_indexes=[0]))
    model = transformers.Qwen3VLMoeForConditionalGeneration(cfg)
    model.save_pretrained(tmp_path)
    tensors = {}
    for f in tmp_path.glob("*.safetensors"):
        tensors.update(load_file(f))
    names = [n for n in tensors if ".mlp." in n and "language_model" in n]
    gate_up = next(tensors[n] for n in names if n.endswith("experts.gate_up_proj"))
    down = next(tensors[n] for n in names if n.endswith("experts.down_proj"))
    assert tuple(gate_up.shape) == (EXPERTS, 2 * INTER, HIDDEN), names
    assert tuple(down.shape) == (EXPERTS, HIDDEN, INTER), names
    assert not any("shared" in n for n in names)  # Qwen3-VL-MoE has no shared experts


def test_load_shard_rejects_a_foreign_shape():
    exp = Experts(EXPERTS, HIDDEN, INTER, TPGroup.single())
    with pytest.raises(ValueError, match="neither"):
        exp.load_shard(exp.down_proj, torch.zeros(EXPERTS, HIDDEN, INTER + 1))


# ---------------------------------------------------------------- the whole LM over the paged KV cache


@pytest.fixture(scope="module")
def tiny_moe_path(tiny_qwen3_vl_path, tmp_path_factory):
    """A tiny Qwen3-VL-MoE checkpoint: the tiny Qwen3-VL's tokenizer, processor and shapes, its MLPs replaced by
    16 experts top-4 (layer 0 kept dense through ``mlp_only_layers``), random weights of a fixed seed, written by
    transformers' ``save_pretrained``."""
    import json
    import shutil

    src = tmp_path_factory.mktemp("tiny-moe")
    shutil.copytree(tiny_qwen3_vl_path, src, dirs_exist_ok=True)
    for f in list(src.glob("*.safetensors*")):
        f.unlink()
    cfg = json.loads((src / "config.json").read_text())
    text = dict(cfg["text_config"], num_experts=EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=[0],
                moe_intermediate_size=cfg["text_config"]["intermediate_size"] // 4, decoder_sparse_step=1)
    text.pop("model_type", None)
    vision = dict(cfg["vision_config"])
    vision.pop("model_type", None)
    moe_cfg = transformers.Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        **{k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
           if k in cfg})
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(moe_cfg).float()
    with torch.no_grad():  # the init's std is tiny: spread the router so top-k really varies by token
        for layer in model.model.language_model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(src)
    return str(src)


def test_text_greedy_matches_transformers(tiny_moe_path):
    from test_qwen3_vl_model import Seq3, greedy
    from test_model_runtime import Pages

    from epdserve.engine.model_runner import ModelRunner
    from epdserve.models.config import ModelConfig

    cfg = ModelConfig.load(tiny_moe_path)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == \
        ("qwen3_vl_moe", EXPERTS, TOP_K, (0,))
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    steps, page_size = 9, 16
    runner = ModelRunner(tiny_moe_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=64,
                         page_size=page_size, attention_backend="sdpa")
    assert sum(isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.layers) == cfg.num_layers - 1
    seq = Seq3(ids[0], [], Pages(64, seed=1).take(-(-(ids.shape[1] + steps) // page_size)), page_size)
    first, tokens = greedy(runner, seq, steps)
    with torch.no_grad():
        ref_logits = hf(input_ids=ids).logits[0, -1]
        ref = hf.generate(input_ids=ids, max_new_tokens=steps, do_sample=False)[0, ids.shape[1]:].tolist()
    torch.testing.assert_close(first, ref_logits, atol=1e-4, rtol=1e-4)
    assert tokens[:len(ref)] == ref


@pytest.mark.parametrize("photos", [["chelsea"], ["chelsea", "coffee"]])
def test_photo_greedy_matches_transformers(tiny_moe_path, photo_paths, photos):
    """Our encoder (the MoE checkpoint's Qwen3-VL tower, DeepStack levels) feeds our MoE LM; the greedy tokens
    equal transformers' ``generate()``."""
    import test_qwen3_vl_model as dense
    from test_model_runtime import Pages

    from epdserve.encoder.vision import VisionEncoder
    from epdserve.engine.model_runner import ModelRunner
    from epdserve.models.config import ModelConfig

    hf = dense.HF3.__new__(dense.HF3)  # the dense test's prompt/seq helpers over the MoE model
    hf.path, hf.cfg = tiny_moe_path, ModelConfig.load(tiny_moe_path)
    hf.model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_path,
                                                                               dtype=torch.float32).eval()
    hf.processor = transformers.AutoProcessor.from_pretrained(tiny_moe_path)
    paths = [photo_paths[p] for p in photos]
    inputs = hf.prompt(paths)
    n, steps, page_size = inputs["input_ids"].shape[1], 9, 16
    runner = ModelRunner(tiny_moe_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=256,
                         page_size=page_size, attention_backend="sdpa")
    features = dense.ours(VisionEncoder(tiny_moe_path, "cpu", "float32"), paths)
    seq = hf.seq(inputs, Pages(256, seed=3).take(-(-(n + steps) // page_size)), page_size, features)
    first, tokens = dense.greedy(runner, seq, steps)
    with torch.no_grad():
        ref_logits = hf.model(**inputs).logits[0, -1]
        ref = hf.model.generate(**inputs, max_new_tokens=steps, do_sample=False)[0, n:].tolist()
    torch.testing.assert_close(first, ref_logits, atol=1e-4, rtol=1e-4)
    assert tokens[:len(ref)] == ref
