"""Qwen3-VL-MoE (issue 50) through the whole pipeline against transformers' generate() on the tiny MoE checkpoint
(``make-tiny-model --arch qwen3-vl-moe``: every decoder layer a sparse block of 32 experts, top-2, experts stored
in the released transposed layout).

Greedy output through `epdserve launch` must equal ``generate(do_sample=False)`` token for token: text, one photo,
two photos, a multi-turn chat (streaming and not), a generated video alone and after a photo, a radix-cache hit
over an image, and n=2 greedy choices. Two launches: prefill and decode at TP=1, and at TP=2 over gloo (every rank
routes every token alike and holds half of each expert's intermediate features; one all-reduce sums them). A
router that picked other experts than transformers', wrong renormalised weights, or expert halves summed wrongly
would change the tokens.
"""

from __future__ import annotations

import pytest

from conftest import hf_reference_model, launched
from test_e2e import CASES, NEW_TOKENS, _chat, _hf_reference, _openai_messages, _resolve, check_parity
from test_video_e2e import check_video_case


@pytest.fixture(scope="module")
def hf_moe(tiny_qwen3_vl_moe_path):
    return hf_reference_model(tiny_qwen3_vl_moe_path, "Qwen3VLMoeForConditionalGeneration")


@pytest.fixture(scope="module")
def references(hf_moe, photo_paths):
    """Per case, transformers' ``(prompt ids, greedy ids, text)``, computed once for the module."""
    return {case: _hf_reference(hf_moe, _resolve(case, photo_paths), NEW_TOKENS) for case in CASES}


LAUNCHES = {
    "tp1": (),
    "tp2": ("--device", "cpu", "--prefill-tp", "2", "--decode-tp", "2"),
}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def moe_server(request, tiny_qwen3_vl_moe_path, tmp_path_factory):
    with launched(tiny_qwen3_vl_moe_path, tmp_path_factory.mktemp(f"moe-{request.param}"),
                  *LAUNCHES[request.param]) as out:
        yield out


def test_the_checkpoint_is_sparse_everywhere(hf_moe):
    """What the parity below exercises: every layer routes (no dense MLP), the router really spreads tokens."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    layers = hf_moe[1].model.language_model.layers
    assert all(isinstance(layer.mlp, Qwen3VLMoeTextSparseMoeBlock) for layer in layers)
    assert (len(layers[0].mlp.experts.gate_up_proj), layers[0].mlp.gate.top_k) == (32, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(moe_server, references, tiny_qwen3_vl_moe_path, photo_paths, case):
    url, _ = moe_server
    check_parity(url, tiny_qwen3_vl_moe_path, _resolve(case, photo_paths), references[case])


@pytest.mark.parametrize("case", ["video", "video_photo"])
def test_video_parity_with_transformers(moe_server, hf_moe, tiny_qwen3_vl_moe_path, photo_paths, case):
    check_video_case(moe_server[0], tiny_qwen3_vl_moe_path, hf_moe, case, photo_paths["rocket"].read_bytes())


def test_radix_hit_over_the_image_matches_transformers(moe_server, hf_moe, tiny_qwen3_vl_moe_path, photo_paths):
    """The same photo and text twice: the second request reuses the first one's KV past the image (cached
    tokens > 0) and still equals transformers."""
    url, _ = moe_server
    shared = "Look at this picture carefully, then answer the question below in one short paragraph. "
    turns = [("user", [photo_paths["coffee"], shared + "Which colours do you see, and where are they?"])]
    ref_prompt, ref_ids, ref_text = _hf_reference(hf_moe, turns, NEW_TOKENS)
    first = _chat(url, tiny_qwen3_vl_moe_path, _openai_messages(turns))
    again = _chat(url, tiny_qwen3_vl_moe_path, _openai_messages(turns))
    image_end = max(i for i, t in enumerate(ref_prompt) if t == hf_moe[1].config.image_token_id) + 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end
    for resp in (first, again):
        assert resp["prompt_token_ids"] == ref_prompt
        assert resp["choices"][0]["token_ids"] == ref_ids and resp["choices"][0]["message"]["content"] == ref_text


def test_n2_greedy_choices_equal_transformers(moe_server, references, tiny_qwen3_vl_moe_path, photo_paths):
    url, _ = moe_server
    _, ref_ids, ref_text = references["one_photo"]
    resp = _chat(url, tiny_qwen3_vl_moe_path, _openai_messages(_resolve("one_photo", photo_paths)), n=2)
    assert [(c["index"], c["token_ids"], c["message"]["content"]) for c in resp["choices"]] == \
        [(0, ref_ids, ref_text), (1, ref_ids, ref_text)]
    assert resp["usage"]["completion_tokens"] == 2 * NEW_TOKENS
