"""The LM runtime (config, weights, M-RoPE, paged attention, ModelRunner, sampling) against transformers."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.wire.messages import SamplingParams
from epdserve.engine.model_runner import ModelRunner
from epdserve.models.config import ModelConfig
from epdserve.models.mrope import decode_positions, mrope_positions
from epdserve.engine.sampling import sample

CPU = torch.device("cpu")


# ---------------------------------------------------------------- helpers


class Seq:
    """A request's token ids, M-RoPE positions and shuffled KV pages, as a scheduler would hold them."""

    def __init__(self, ids, images, pages, page_size, mm_embeds=None, image_token_id=None, merge=2):
        self.ids = torch.as_tensor(ids, dtype=torch.int64)
        self.pos, self.delta = mrope_positions(len(self.ids), images, merge)
        self.pages, self.ps = pages, page_size
        self.mm_embeds = mm_embeds
        self.mm_mask = (self.ids == image_token_id) if mm_embeds is not None else None
        self.cached = 0

    def slots(self, start, end):
        i = torch.arange(start, end)
        return torch.tensor(self.pages)[i // self.ps] * self.ps + i % self.ps

    def extend_part(self, end):
        """Fields for an extend of tokens ``cached .. end``."""
        s, e = self.cached, end
        mm = None
        if self.mm_mask is not None:
            before = int(self.mm_mask[:s].sum())
            mask = self.mm_mask[s:e]
            mm = (self.mm_embeds[before:before + int(mask.sum())], mask)
        self.cached = e
        return dict(ids=self.ids[s:e], pos=self.pos[:, s:e], slots=self.slots(s, e), q=e - s, kv=e,
                    pages=self.pages, mm=mm)

    def decode_part(self, token):
        """Fields for decoding ``token`` at sequence index ``cached``."""
        i = self.cached
        self.cached += 1
        pos = decode_positions(torch.tensor([i]), torch.tensor([self.delta]))
        return dict(ids=torch.tensor([token]), pos=pos, slots=self.slots(i, i + 1), q=1, kv=i + 1,
                    pages=self.pages, mm=None)


def make_batch(parts, is_decode=False):
    hidden = next((p["mm"][0].shape[1] for p in parts if p["mm"] is not None), None)
    mm_embeds = mm_mask = None
    if hidden is not None:
        mm_mask = torch.cat([p["mm"][1] if p["mm"] else torch.zeros(p["q"], dtype=torch.bool) for p in parts])
        mm_embeds = torch.cat([p["mm"][0] for p in parts if p["mm"]])
    return ForwardBatch(
        is_decode=is_decode, input_ids=torch.cat([p["ids"] for p in parts]),
        positions=torch.cat([p["pos"] for p in parts], dim=1), out_slots=torch.cat([p["slots"] for p in parts]),
        q_lens=[p["q"] for p in parts], kv_lens=[p["kv"] for p in parts], page_table=[p["pages"] for p in parts],
        mm_embeds=mm_embeds, mm_mask=mm_mask)


class Pages:
    """Hands out shuffled, non-contiguous page ids (the schedulers own real allocation)."""

    def __init__(self, num_pages, seed=0):
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n):
        out, self.free = self.free[:n], self.free[n:]
        return out


def image_spans(ids, grid_thw, image_token_id, merge=2):
    ids = ids.tolist()
    spans, i = [], 0
    for grid in grid_thw.tolist():
        i = ids.index(image_token_id, i)
        spans.append((i, grid))
        i += grid[0] * grid[1] * grid[2] // merge ** 2
    return spans


# ---------------------------------------------------------------- fixtures


class HF:
    """A transformers model + processor of one tiny checkpoint, and prompts built with them."""

    def __init__(self, path, arch):
        from transformers import AutoProcessor

        if arch == "qwen2_5_vl":
            from transformers import Qwen2_5_VLForConditionalGeneration as Model
        else:
            from transformers import Qwen2VLForConditionalGeneration as Model
        self.path = path
        self.model = Model.from_pretrained(path, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(path)
        self.cfg = ModelConfig.load(path)

    def prompt(self, photos, text="Describe this image."):
        from PIL import Image

        content = [{"type": "image"} for _ in photos] + [{"type": "text", "text": text}]
        chat = self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=False)
        images = [Image.open(p).convert("RGB") for p in photos] or None
        return self.processor(text=[chat], images=images, return_tensors="pt")

    def image_embeds(self, inputs):
        with torch.no_grad():
            out = self.model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                      image_grid_thw=inputs["image_grid_thw"])
        return torch.cat(list(getattr(out, "pooler_output", out)))

    def seq(self, inputs, pages, page_size):
        ids = inputs["input_ids"][0]
        if "pixel_values" not in inputs:
            return Seq(ids, [], pages, page_size)
        spans = image_spans(ids, inputs["image_grid_thw"], self.cfg.image_token_id)
        return Seq(ids, spans, pages, page_size, self.image_embeds(inputs), self.cfg.image_token_id)


@pytest.fixture(scope="module")
def hf25(tiny_model_path):
    return HF(tiny_model_path, "qwen2_5_vl")


@pytest.fixture(scope="module")
def hf2(tiny_qwen2_vl_path):
    return HF(tiny_qwen2_vl_path, "qwen2_vl")


@pytest.fixture(scope="module")
def runner25(tiny_model_path):
    return ModelRunner(tiny_model_path, device=CPU, dtype=torch.float32, num_pages=1024, page_size=16,
                       attention_backend="sdpa")


# ---------------------------------------------------------------- config and weights


def test_config_tiny_checkpoints(tiny_model_path, tiny_qwen2_vl_path):
    for path, mtype in ((tiny_model_path, "qwen2_5_vl"), (tiny_qwen2_vl_path, "qwen2_vl")):
        c = ModelConfig.load(path)
        assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_layers) == (mtype, 128, 256, 2)
        assert (c.num_heads, c.num_kv_heads, c.head_dim, c.mrope_section) == (4, 2, 32, (4, 6, 6))
        assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6 and c.spatial_merge_size == 2
        assert c.vocab_size == json.loads((Path(path) / "config.json").read_text())["text_config"]["vocab_size"]
        assert (c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id) == (5, 6, 3, 4)
        assert c.eos_token_ids == (0, 2) and c.tie_word_embeddings is False


def test_config_old_hub_layout(tmp_path):
    cfg = {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "vocab_size": 151936,
        "tie_word_embeddings": True, "eos_token_id": 151645, "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "embed_dim": 1280, "spatial_merge_size": 2},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    c = ModelConfig.load(tmp_path)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (1536, 28, 12, 2, 128)
    assert c.mrope_section == (16, 24, 24) and c.rope_theta == 1e6 and c.tie_word_embeddings
    assert c.eos_token_ids == (151643, 151645) and c.max_position_embeddings == 32768
    cfg["model_type"] = "llava"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.load(tmp_path / "nowhere")


def test_weights_sharded_new_layout_tied(tiny_model_path, tmp_path):
    """transformers-5 key names, two shards with an index, no lm_head and tied embeddings."""
    src = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in src.items() if k != "lm_head.weight"}
    keys = sorted(renamed)
    shards = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: renamed[k] for k in ks}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    cfg = json.loads((Path(tiny_model_path) / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = ModelRunner(str(tmp_path), device=CPU, dtype=torch.float32, num_pages=8, page_size=4,
                    attention_backend="sdpa")
    m = r.model
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    assert torch.equal(m.embed_tokens.weight, src["model.embed_tokens.weight"])
    qkv = torch.cat([src[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(m.layers[1].self_attn.qkv_proj.bias, qkv)


# ---------------------------------------------------------------- M-RoPE


@pytest.mark.parametrize("names", [[], ["chelsea"], ["rocket", "camera"]])
def test_mrope_matches_transformers(hf25, photo_paths, names):
    inputs = hf25.prompt([photo_paths[n] for n in names])
    ids = inputs["input_ids"]
    grid = inputs.get("image_grid_thw")
    spans = image_spans(ids[0], grid, hf25.cfg.image_token_id) if names else []
    pos, delta = mrope_positions(ids.shape[1], spans, 2)
    if names:
        ref, ref_delta = hf25.model.model.get_rope_index(ids, inputs["mm_token_type_ids"], grid)
        assert torch.equal(pos, ref[:, 0]) and delta == int(ref_delta)
        assert delta < 0
    else:
        assert torch.equal(pos, torch.arange(ids.shape[1]).expand(3, -1)) and delta == 0
    assert torch.equal(decode_positions(torch.tensor([7, 9]), torch.tensor([delta, 0])),
                       torch.tensor([[7 + delta, 9]] * 3))


# ---------------------------------------------------------------- parity with transformers


def greedy(runner, seq, steps):
    """Prefill ``seq`` then decode greedily; returns (prefill logits [V], tokens [steps])."""
    first = runner.forward(make_batch([seq.extend_part(len(seq.ids))]))[0]
    tokens = [int(first.argmax())]
    for _ in range(steps - 1):
        logits = runner.forward(make_batch([seq.decode_part(tokens[-1])], is_decode=True))
        tokens.append(int(logits[0].argmax()))
    return first, tokens


@pytest.mark.parametrize("arch,photos,page_size", [
    ("qwen2_5_vl", [], 16), ("qwen2_5_vl", ["chelsea"], 16), ("qwen2_5_vl", ["chelsea"], 7),
    ("qwen2_vl", ["coffee"], 5),
])
def test_logits_and_greedy_match_transformers(request, photo_paths, arch, photos, page_size):
    hf = request.getfixturevalue("hf25" if arch == "qwen2_5_vl" else "hf2")
    inputs = hf.prompt([photo_paths[p] for p in photos])
    n, steps = inputs["input_ids"].shape[1], 9
    if page_size != 16:
        assert n % page_size, "the page size must not divide the prompt length"
    runner = ModelRunner(hf.path, device=CPU, dtype=torch.float32, num_pages=256, page_size=page_size,
                         attention_backend="sdpa")
    seq = hf.seq(inputs, Pages(256, seed=page_size).take(-(-(n + steps) // page_size)), page_size)
    first, tokens = greedy(runner, seq, steps)
    with torch.no_grad():
        ref_logits = hf.model(**inputs).logits[0, -1]
        ref = hf.model.generate(**inputs, max_new_tokens=steps, do_sample=False)[0, n:].tolist()
    torch.testing.assert_close(first, ref_logits, atol=1e-4, rtol=1e-4)
    assert len(ref) >= 1
    assert tokens[:len(ref)] == ref  # generate may stop early at an eos


# ---------------------------------------------------------------- prefix reuse and batching


def test_prefix_reuse_matches_one_shot(hf25, runner25, photo_paths):
    inputs = hf25.prompt([photo_paths["astronaut"]])
    n, ps = inputs["input_ids"].shape[1], runner25.page_size
    pages = Pages(runner25.num_pages, seed=1)
    one = hf25.seq(inputs, pages.take(-(-n // ps)), ps)
    ref = runner25.forward(make_batch([one.extend_part(n)]))
    for split in (37, n // 2 + 3, n - 1):  # not page aligned; in the image; a single-token extend
        two = hf25.seq(inputs, pages.take(-(-n // ps)), ps)
        runner25.forward(make_batch([two.extend_part(split)]))
        out = runner25.forward(make_batch([two.extend_part(n)]))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_aligned_image_rows_and_last_rows_match_packed(hf25, runner25, photo_paths):
    """The graph-safe form of a prefill (image embeddings aligned with the tokens and spliced by ``torch.where``;
    the last row given as a tensor) computes exactly what the packed form does, for a whole prompt and for an
    extend that starts inside the image."""
    import dataclasses

    inputs = hf25.prompt([photo_paths["astronaut"]])
    n, ps = inputs["input_ids"].shape[1], runner25.page_size
    pages = Pages(runner25.num_pages, seed=4)
    packed, aligned = (hf25.seq(inputs, pages.take(-(-n // ps)), ps) for _ in range(2))
    for end in (n // 2, n):  # the second extend starts inside the image and has a cached prefix
        want = runner25.forward(make_batch([packed.extend_part(end)]))
        batch = make_batch([aligned.extend_part(end)])
        assert batch.mm_embeds.shape[0] < batch.input_ids.shape[0]  # the test covers the packed form too
        rows = torch.zeros(batch.input_ids.shape[0], batch.mm_embeds.shape[1])
        rows[batch.mm_mask] = batch.mm_embeds
        rows[~batch.mm_mask] = float("nan")  # rows outside the mask must not leak in
        batch = dataclasses.replace(batch, mm_embeds=rows, last_rows=torch.tensor([batch.q_lens[0] - 1]))
        assert torch.equal(runner25.forward(batch), want)


def test_batched_extend_and_decode_match_alone(hf25, runner25, photo_paths):
    ps = runner25.page_size
    pages = Pages(runner25.num_pages, seed=2)
    prompts = [hf25.prompt([photo_paths["coffee"]]), hf25.prompt([], text="Tell me a story about the picture.")]

    def fresh():
        return [hf25.seq(p, pages.take(-(-(p["input_ids"].shape[1] + 4) // ps)), ps) for p in prompts]

    alone_seqs, batch_seqs = fresh(), fresh()
    # The second request of the batch reuses a cached prefix, so its extend is ragged against its KV.
    runner25.forward(make_batch([batch_seqs[1].extend_part(5)]))
    alone = [runner25.forward(make_batch([s.extend_part(len(s.ids))]))[0] for s in alone_seqs]
    both = runner25.forward(make_batch([s.extend_part(len(s.ids)) for s in batch_seqs]))
    for i in range(2):
        torch.testing.assert_close(both[i], alone[i], atol=1e-5, rtol=1e-5)
    tokens = [int(a.argmax()) for a in alone]
    for _ in range(3):
        alone = [runner25.forward(make_batch([s.decode_part(t)], is_decode=True))[0]
                 for s, t in zip(alone_seqs, tokens)]
        both = runner25.forward(make_batch([s.decode_part(t) for s, t in zip(batch_seqs, tokens)], is_decode=True))
        for i in range(2):
            torch.testing.assert_close(both[i], alone[i], atol=1e-5, rtol=1e-5)
        tokens = [int(a.argmax()) for a in alone]


def test_kv_read_write_roundtrip(hf25, runner25):
    """A prompt's KV moved to other pages (a transfer) decodes exactly like the original."""
    ps = runner25.page_size
    pages = Pages(runner25.num_pages, seed=3)
    inputs = hf25.prompt([], text="How many objects are there?")
    n = inputs["input_ids"].shape[1]
    src = hf25.seq(inputs, pages.take(-(-(n + 1) // ps)), ps)
    dst = hf25.seq(inputs, pages.take(-(-(n + 1) // ps)), ps)
    token = int(runner25.forward(make_batch([src.extend_part(n)]))[0].argmax())
    kv = runner25.read_kv(src.slots(0, n))
    cfg = runner25.config
    assert kv.shape == (cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim) and kv.is_contiguous()
    runner25.write_kv(dst.slots(0, n), kv)
    dst.cached = n
    a = runner25.forward(make_batch([src.decode_part(token)], is_decode=True))
    b = runner25.forward(make_batch([dst.decode_part(token)], is_decode=True))
    assert torch.equal(a, b)


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("n, hq, hkv, d", [(1, 4, 2, 8), (5, 16, 2, 16), (3, 8, 8, 4)])
def test_kv_write_of_a_fused_qkv_row_equals_two_writes(n, hq, hkv, d):
    """K and V as the attention layers pass them (column blocks of one qkv output row) go in with one indexed
    copy; the pool ends up exactly as with K and V written apart. Copies of K and V (not adjacent) and V before K
    take the two-write path."""
    from epdserve.kvcache.kv_pool import KVPool, _adjacent_kv

    torch.manual_seed(n)
    q, k, v = torch.randn(n, (hq + 2 * hkv) * d, dtype=torch.bfloat16).split([hq * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(-1, hkv, d), v.view(-1, hkv, d)
    pools = [KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                    device="cpu") for _ in range(2)]
    slots = torch.randperm(16)[:n]
    assert _adjacent_kv(k, v, torch.bfloat16) is not None
    pools[0].write(1, slots, k, v)
    pools[1].write(1, slots, k.clone(), v.clone())
    assert torch.equal(pools[0].buffer, pools[1].buffer) and pools[0].buffer[1].abs().sum() > 0
    assert pools[0].buffer[0].abs().sum() == 0  # the other layer untouched
    assert _adjacent_kv(k.clone(), v.clone(), torch.bfloat16) is None
    assert _adjacent_kv(v, k, torch.bfloat16) is None
    assert _adjacent_kv(k, v, torch.float32) is None  # a cast is due: two writes


def test_sampling():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    greedy_p = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(sample(logits, greedy_p, [None] * 6), logits.argmax(-1))
    hot = [SamplingParams(temperature=1.3, top_p=0.9, top_k=20)] * 6

    def seeded():
        return [torch.Generator().manual_seed(i) for i in range(6)]

    a, b = sample(logits, hot, seeded()), sample(logits, hot, seeded())
    assert torch.equal(a, b)
    # A seeded row is the same whatever it is batched with.
    assert int(sample(logits[3:4], hot[:1], seeded()[3:4])[0]) == int(a[3])
    draws = torch.stack([sample(logits, hot, [None] * 6) for _ in range(20)])
    ranks = logits.argsort(-1, descending=True)[:, :20]
    assert all(int(t) in ranks[i].tolist() for row in draws for i, t in enumerate(row))
    assert len(set(draws[:, 0].tolist())) > 1
    assert torch.equal(sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 6, seeded()), logits.argmax(-1))
    assert torch.equal(sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 6, seeded()),
                       logits.argmax(-1))
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = sample(logits, mixed, [None] * 6)
    assert torch.equal(out[::2], logits.argmax(-1)[::2]) and out.dtype == torch.int64


# ---------------------------------------------------------------- GPU: flashinfer vs SDPA


def _write_lm_checkpoint(path: Path, heads: int, kv_heads: int) -> None:
    """An old-hub-layout LM-only checkpoint with real head_dim 128 (flashinfer's kernels need it)."""
    hidden, inter, layers, vocab = heads * 128, 512, 2, 600
    torch.manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden) * 0.02, "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": torch.randn(vocab, hidden) * 0.02}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (heads * 128, hidden)), ("self_attn.k_proj", (kv_heads * 128, hidden)),
                            ("self_attn.v_proj", (kv_heads * 128, hidden))):
            w[p + name + ".weight"] = torch.randn(shape) * 0.02
            w[p + name + ".bias"] = torch.randn(shape[0]) * 0.02
        w[p + "self_attn.o_proj.weight"] = torch.randn(hidden, heads * 128) * 0.02
        w[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden) * 0.02
        w[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden) * 0.02
        w[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter) * 0.02
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(w, str(path / "model.safetensors"))
    cfg = dict(model_type="qwen2_5_vl", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, rope_theta=1e6,
               rms_norm_eps=1e-6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
               tie_word_embeddings=False, image_token_id=5, vision_config={"spatial_merge_size": 2})
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)])
def test_flashinfer_matches_sdpa_cuda(tmp_path, heads, kv_heads):
    pytest.importorskip("flashinfer")
    _write_lm_checkpoint(tmp_path, heads, kv_heads)
    dev, ps = torch.device("cuda"), 16
    kw = dict(device=dev, dtype=torch.bfloat16, num_pages=256, page_size=ps)
    fi = ModelRunner(str(tmp_path), attention_backend="flashinfer", **kw)
    ref = ModelRunner(str(tmp_path), attention_backend="sdpa", **kw)
    assert type(fi.backend).__name__ == "FlashInferBackend"
    gen = torch.Generator().manual_seed(0)
    lens = [37, 100, 16]
    prompts = [torch.randint(10, 600, (n,), generator=gen) for n in lens]
    pages = Pages(256, seed=4)
    page_lists = [pages.take(-(-(n + 10) // ps)) for n in lens]
    seqs = {r: [Seq(p, [], pl, ps) for p, pl in zip(prompts, page_lists)] for r in ("fi", "ref")}
    runners = {"fi": fi, "ref": ref}

    def both(build):
        return {k: runners[k].forward(build(seqs[k])) for k in runners}

    # Extend with a cached prefix for request 1, then a mixed batch.
    both(lambda s: make_batch([s[1].extend_part(50)]))
    out = both(lambda s: make_batch([q.extend_part(len(q.ids)) for q in s]))
    torch.testing.assert_close(out["fi"], out["ref"], atol=2e-2, rtol=2e-2)
    worst = float((out["fi"] - out["ref"]).abs().max())
    tokens = out["ref"].argmax(-1).tolist()
    for _ in range(8):  # teacher-forced on the SDPA tokens so one near-tie cannot derail the comparison
        out = both(lambda s: make_batch([q.decode_part(t) for q, t in zip(s, tokens)], is_decode=True))
        torch.testing.assert_close(out["fi"], out["ref"], atol=2e-2, rtol=2e-2)
        worst = max(worst, float((out["fi"] - out["ref"]).abs().max()))
        top2 = out["ref"].topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 4e-2
        assert torch.equal(out["fi"].argmax(-1)[clear], out["ref"].argmax(-1)[clear])
        tokens = out["ref"].argmax(-1).tolist()
    print(f"{heads} heads / {kv_heads} KV heads: flashinfer vs SDPA (bf16), an extend and 8 decode steps: "
          f"max |logit difference| {worst:.3g} (atol 2e-2 + rtol 2e-2); argmax equal where not a near-tie")


def test_backend_choice_on_cpu():
    from epdserve.attention.select import make_backend
    from epdserve.attention.sdpa import SdpaBackend
    from epdserve.kvcache.kv_pool import KVPool

    pool = KVPool(num_layers=1, num_pages=2, page_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                  device=CPU)
    assert isinstance(make_backend("auto", pool, 4), SdpaBackend)
    with pytest.raises(ValueError, match="CUDA"):
        make_backend("flashinfer", pool, 4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("xformers", pool, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_replan_before_the_gpu_ran_the_previous_plan():
    # flashinfer's plan() writes its split-KV schedule into ONE pinned host buffer per wrapper and queues an async
    # copy of it; the overlap scheduler plans step N+1 while step N may still be queued. Hold the GPU busy, plan
    # and launch a long-context batch, re-plan the same wrapper for a short one: the first batch's output must
    # not change (without the wait in prepare() its queued copy would carry the second schedule).
    pytest.importorskip("flashinfer")
    from epdserve.attention.flashinfer import FlashInferBackend
    from epdserve.engine.forward_batch import ForwardBatch
    from epdserve.kvcache.kv_pool import KVPool

    dev, ps, heads, kv_heads, dim = torch.device("cuda"), 16, 16, 2, 128
    pool = KVPool(num_layers=1, num_pages=600, page_size=ps, num_kv_heads=kv_heads, head_dim=dim,
                  dtype=torch.bfloat16, device=dev)
    pool.buffer.normal_(generator=torch.Generator(dev).manual_seed(0))
    fi = FlashInferBackend(pool, heads)

    def batch(kv_lens, tables):
        slots = [t[(n - 1) // ps] * ps + (n - 1) % ps for t, n in zip(tables, kv_lens)]
        b = len(kv_lens)
        # out_slots already on the device, as the CUDA-graph runner hands them over: a CPU tensor would make
        # prepare() copy it with a blocking .to(), which waits for the GPU and hides the race.
        return ForwardBatch(True, torch.zeros(b, dtype=torch.int64), torch.zeros(3, b, dtype=torch.int64),
                            torch.tensor(slots, device=dev), [1] * b, kv_lens, tables)

    long = batch([4000, 3000], [list(range(0, 250)), list(range(250, 438))])  # split-KV over many chunks
    short = batch([17, 20], [[500, 501], [502, 503]])
    gen = torch.Generator(dev).manual_seed(1)
    q = torch.randn(2, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))

    fi.prepare(long)
    want = fi.forward(0, q, k, v)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the next plan's copy waits behind it
    fi.prepare(long)
    got = fi.forward(0, q, k, v)
    fi.prepare(short)
    # Without the wait, the long batch's kernels can run on the short batch's schedule and never finish (the
    # decode server's stall under --kv-transfer shared): poll, so that a regression fails instead of hanging.
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + 30
    while not done.query():
        assert time.monotonic() < deadline, "the GPU never finished the first batch: it ran a stale plan"
        time.sleep(0.01)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    print("flashinfer: a 4000/3000-token decode planned, then the wrapper re-planned for a short batch before the "
          "GPU ran it: the first batch finished with the output it gives alone, bit for bit")


def test_limit_cpu_threads_only_on_cuda_and_only_without_omp_num_threads(monkeypatch):
    from epdserve.device import limit_cpu_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        limit_cpu_threads(torch.device("cpu"))  # the CPU forward keeps its pool
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        limit_cpu_threads(torch.device("cuda"))  # an operator's OMP_NUM_THREADS rules
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        limit_cpu_threads(torch.device("cuda"))  # a GPU server: one thread
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
