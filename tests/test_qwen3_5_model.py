"""Qwen3.5's hybrid language model (Gated DeltaNet + gated attention) against transformers, text only, on CPU:
config loading, prefill logits, greedy decoding over the paged KV cache and the state pool, chunked prefill,
batched decoding across state slots, and the state pool itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_runtime import Pages, Seq, make_batch

from epdserve.engine.distributed import TPGroup
from epdserve.engine.model_runner import ModelRunner
from epdserve.kvcache.state_pool import StatePool
from epdserve.models.config import ModelConfig
from epdserve.models.qwen3_5_lm import Qwen3_5LanguageModel

CPU = torch.device("cpu")
PAGE = 4


@pytest.fixture(scope="module")
def hf35(tiny_qwen3_5_path):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner35(tiny_qwen3_5_path):
    return ModelRunner(tiny_qwen3_5_path, device=CPU, dtype=torch.float32, num_pages=256, page_size=PAGE,
                       attention_backend="sdpa", num_state_slots=4)


@pytest.fixture(scope="module")
def prompts(tiny_qwen3_5_path):
    """Token ids of two text prompts through the checkpoint's processor and chat template: a short one and a long
    one (> 64 tokens, the delta rule's chunk size, so its prefill crosses a chunk boundary)."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_qwen3_5_path)
    texts = ["Describe this image.", "Tell me a story about the picture. " * 10]
    out = []
    for text in texts:
        chat = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                        add_generation_prompt=True, tokenize=False)
        out.append(proc(text=[chat], return_tensors="pt")["input_ids"][0])
    assert len(out[1]) > 66  # test_chunked_prefill_equals_one_extend cuts there
    return out


class Req:
    """A request: its :class:`Seq` (pages, positions) and its state slot, freed by :meth:`close`."""

    def __init__(self, runner, ids, pages):
        self.runner, self.seq = runner, Seq(ids, [], pages.take(-(-(len(ids) + 32) // PAGE)), PAGE)
        self.slot = runner.state_pool.alloc()

    def close(self):
        self.runner.state_pool.free(self.slot)


def run(runner, reqs, parts, is_decode=False):
    """Logits ``[B, vocab]`` of one forward over ``reqs`` with their ``parts``."""
    batch = dataclasses.replace(make_batch(parts, is_decode), state_slots=[r.slot for r in reqs])
    return runner.forward(batch)


def greedy(runner, reqs, first_logits, steps):
    """Greedy tokens of ``reqs`` decoded together: ``[B][steps + 1]`` (the prefill's token first)."""
    toks = [[int(t)] for t in first_logits.argmax(-1)]
    for _ in range(steps):
        logits = run(runner, reqs, [r.seq.decode_part(t[-1]) for r, t in zip(reqs, toks)], is_decode=True)
        for t, row in zip(toks, logits):
            t.append(int(row.argmax()))
    return toks


def hf_generate(hf, ids, steps):
    with torch.no_grad():
        return hf.generate(input_ids=ids[None], max_new_tokens=steps + 1, do_sample=False,
                           eos_token_id=None)[0, len(ids):].tolist()


# ---------------------------------------------------------------- config, checkpoint, pools


def test_config_checkpoint_and_pools(hf35, runner35, tiny_qwen3_5_path):
    from transformers import AutoProcessor, Qwen3VLProcessor

    c, text = ModelConfig.load(tiny_qwen3_5_path), hf35.config.text_config
    assert c.model_type == "qwen3_5" and c.is_hybrid and c.mrope_interleaved
    assert c.layer_types == tuple(text.layer_types) == ("linear_attention", "linear_attention", "full_attention",
                                                        "linear_attention")
    assert (c.head_dim, c.rotary_dim, sum(c.mrope_section)) == (64, 16, 8)  # partial_rotary_factor 0.25
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (text.linear_num_key_heads, text.linear_num_value_heads,
                                          text.linear_key_head_dim, text.linear_value_head_dim,
                                          text.linear_conv_kernel_dim)
    assert c.attention_layers == (2,) and c.linear_layers == (0, 1, 3)
    assert isinstance(AutoProcessor.from_pretrained(tiny_qwen3_5_path), Qwen3VLProcessor)
    assert runner35.kv_pool.num_layers == 1  # KV for the one attention layer only
    pool = runner35.state_pool
    assert pool.layers == 3 and pool.num_slots == 4 and pool.scratch_slot == 4
    assert pool.conv[0].shape == (5, c.linear_conv_dim, 4) and pool.recurrent[0].shape == (5, 4, 32, 32)
    assert pool.bytes_per_slot == 3 * (c.linear_conv_dim * 4 * 4 + 4 * 32 * 32 * 4)


def test_checkpoint_names_map_to_the_lm():
    from epdserve.models.weights import lm_name

    assert lm_name("model.language_model.layers.0.linear_attn.A_log") == "layers.0.linear_attn.A_log"
    assert lm_name("model.language_model.layers.0.linear_attn.conv1d.weight") == "layers.0.linear_attn.conv1d.weight"
    assert lm_name("mtp.layers.0.mlp.gate_proj.weight") is None  # the released checkpoints' MTP head
    assert lm_name("model.visual.blocks.0.attn.qkv.weight") is None


def test_config_derives_layer_types_from_the_interval(tmp_path, tiny_qwen3_5_path):
    import json
    import shutil

    for name in ("config.json", "generation_config.json"):
        shutil.copy(f"{tiny_qwen3_5_path}/{name}", tmp_path / name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["text_config"]["layer_types"]
    cfg["text_config"]["num_hidden_layers"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.load(tmp_path).attention_layers == (3, 7)  # Qwen3_5TextConfig: every 4th layer


def test_state_pool_alloc_free_and_errors():
    pool = StatePool(2, 1, (3, 4), (2, 2, 2), torch.float32, CPU)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {0, 1} and pool.num_free == 0
    with pytest.raises(RuntimeError, match="in use"):
        pool.alloc()
    pool.conv[0][a].fill_(1.0)
    pool.recurrent[0][a].fill_(2.0)
    pool.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(pool.scratch_slot)
    again = pool.alloc()
    assert again == a and not pool.conv[0][again].any() and not pool.recurrent[0][again].any()


def test_model_refuses_unsplittable_heads_and_batches_without_slots(runner35, tiny_qwen3_5_path):
    cfg = ModelConfig.load(tiny_qwen3_5_path)
    with torch.device("meta"):  # 4 ranks: attention heads split, but not the 2 DeltaNet key heads
        with pytest.raises(ValueError, match="linear-attention key heads of 2 cannot be split over 4 TP ranks"):
            Qwen3_5LanguageModel(cfg, tp=dataclasses.replace(TPGroup.single(), size=4))
    seq = Seq(torch.arange(10, 15), [], [0, 1], PAGE)
    with pytest.raises(ValueError, match="state slot"):
        runner35.forward(make_batch([seq.extend_part(5)]))


# ---------------------------------------------------------------- against transformers


def assert_prefill_and_greedy_equal_transformers(hf, runner: ModelRunner, prompts: list[torch.Tensor]) -> None:
    """Each prompt alone: the prefill's last logits equal ``hf``'s (atol 1e-4) and 12 greedy decode steps equal
    ``hf.generate``'s tokens (the Qwen3.5 and Qwen3.5-MoE model tests)."""
    pages = Pages(256)
    for ids in prompts:
        with torch.no_grad():
            want = hf(input_ids=ids[None]).logits[0, -1]
        req = Req(runner, ids, pages)
        try:
            logits = run(runner, [req], [req.seq.extend_part(len(ids))])
            torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=0)
            assert greedy(runner, [req], logits, 12)[0] == hf_generate(hf, ids, 12)
        finally:
            req.close()


def test_prefill_logits_and_greedy_decode_equal_transformers(hf35, runner35, prompts):
    assert_prefill_and_greedy_equal_transformers(hf35, runner35, prompts)


@pytest.mark.parametrize("cut", [5, 66, -1])  # inside the conv window, past one delta-rule chunk, a 1-token tail
def test_chunked_prefill_equals_one_extend(runner35, prompts, cut):
    ids = prompts[1]
    pages = Pages(256, seed=1)
    whole, split = Req(runner35, ids, pages), Req(runner35, ids, pages)
    try:
        one = run(runner35, [whole], [whole.seq.extend_part(len(ids))])
        cut = cut % len(ids)
        run(runner35, [split], [split.seq.extend_part(cut)])
        two = run(runner35, [split], [split.seq.extend_part(len(ids))])
        torch.testing.assert_close(two, one, atol=1e-5, rtol=0)
        assert greedy(runner35, [split], two, 8) == greedy(runner35, [whole], one, 8)
    finally:
        whole.close()
        split.close()


def assert_batch_equals_each_alone(runner: ModelRunner, prompts: list[list[int]]) -> None:
    """``prompts`` prefilled and greedy-decoded 10 steps in one batch (each on its own state slot) give each
    one's tokens alone."""
    pages = Pages(256, seed=2)
    alone = []
    for ids in prompts:
        req = Req(runner, ids, pages)
        try:
            alone.append(greedy(runner, [req], run(runner, [req], [req.seq.extend_part(len(ids))]), 10)[0])
        finally:
            req.close()
    reqs = [Req(runner, ids, pages) for ids in prompts]
    try:
        first = run(runner, reqs, [r.seq.extend_part(len(ids)) for r, ids in zip(reqs, prompts)])
        assert reqs[0].slot != reqs[1].slot
        assert greedy(runner, reqs, first, 10) == alone
    finally:
        for r in reqs:
            r.close()


def test_two_requests_in_one_batch_equal_each_alone(runner35, prompts):
    assert_batch_equals_each_alone(runner35, prompts)


def test_a_reused_slot_starts_from_zeros(runner35, prompts):
    pages = Pages(256, seed=3)
    ids = prompts[0]
    req = Req(runner35, ids, pages)
    first = run(runner35, [req], [req.seq.extend_part(len(ids))])
    greedy(runner35, [req], first, 4)  # the slot now holds a non-zero state
    slot = req.slot
    req.close()
    again = Req(runner35, ids, pages)
    try:
        pool = runner35.state_pool
        assert again.slot == slot
        assert all(not c[slot].any() for c in pool.conv) and all(not r[slot].any() for r in pool.recurrent)
        torch.testing.assert_close(run(runner35, [again], [again.seq.extend_part(len(ids))]), first, atol=0, rtol=0)
    finally:
        again.close()


def test_a_fresh_request_ignores_what_its_slot_holds(runner35, prompts):
    """A first extend starts from the zero state even over a dirty slot (TP ranks other than 0 never see the
    allocation, so they cannot rely on alloc() zeroing it)."""
    pages = Pages(256, seed=4)
    ids = prompts[0]
    req = Req(runner35, ids, pages)
    try:
        clean = run(runner35, [req], [req.seq.extend_part(len(ids))])
        pool = runner35.state_pool
        for conv, rec in zip(pool.conv, pool.recurrent):
            conv[req.slot].normal_()
            rec[req.slot].normal_()
        req.seq = Seq(ids, [], req.seq.pages, PAGE)
        torch.testing.assert_close(run(runner35, [req], [req.seq.extend_part(len(ids))]), clean, atol=0, rtol=0)
    finally:
        req.close()
