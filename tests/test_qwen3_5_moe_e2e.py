"""Qwen3.5-MoE (issue 50) through the whole pipeline against transformers' generate() on the tiny checkpoint
(``make-tiny-model --arch qwen3.5-moe``: the tiny Qwen3.5's DeltaNet and attention layers, each with 16 routed
experts top-2 and a gated shared expert, experts fused as released).

Greedy output through `epdserve launch` (small prefill chunks) must equal ``generate(do_sample=False)`` token for
token: text, one photo, two photos, a multi-turn chat (streaming and not), a generated video alone and after a
photo, a prompt prefilled in chunks and then a radix hit on its DeltaNet state snapshot, and n=2 greedy choices.
A second launch at TP=2 over gloo (DeltaNet heads, expert and shared-expert features split over the ranks) runs a
photo, a video and the chunked prompt with its radix hit.
"""

from __future__ import annotations

import pytest

from conftest import hf_reference_model, launched
from test_e2e import CASES, NEW_TOKENS, _chat, _hf_reference, _openai_messages, _resolve, check_parity
from test_qwen3_5_e2e import CHUNK, LONG, PAGE
from test_video_e2e import check_video_case

CHUNKED = ("--prefill-chunked-prefill-size", str(CHUNK))


@pytest.fixture(scope="module")
def hf_moe(tiny_qwen3_5_moe_path):
    return hf_reference_model(tiny_qwen3_5_moe_path, "Qwen3_5MoeForConditionalGeneration")


@pytest.fixture(scope="module")
def references(hf_moe, photo_paths):
    """Per case, transformers' ``(prompt ids, greedy ids, text)``, computed once for the module."""
    refs = {case: _hf_reference(hf_moe, _resolve(case, photo_paths), NEW_TOKENS) for case in CASES}
    refs["long"] = _hf_reference(hf_moe, LONG, NEW_TOKENS)
    return refs


@pytest.fixture(scope="module")
def moe_server(tiny_qwen3_5_moe_path, tmp_path_factory):
    with launched(tiny_qwen3_5_moe_path, tmp_path_factory.mktemp("q35moe"), *CHUNKED) as out:
        yield out


def _chunked_then_radix_hit(url: str, model: str, reference) -> None:
    """The long prompt (over four chunks), then again: the second skips the prefix up to its last page boundary
    (restoring the DeltaNet state snapshot there); both equal transformers."""
    n = len(reference[0])
    assert n > 4 * CHUNK
    first = _chat(url, model, _openai_messages(LONG))
    assert first["choices"][0]["token_ids"] == reference[1]
    again = check_parity(url, model, LONG, reference)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE > 0


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(moe_server, references, tiny_qwen3_5_moe_path, photo_paths, case):
    check_parity(moe_server[0], tiny_qwen3_5_moe_path, _resolve(case, photo_paths), references[case])


@pytest.mark.parametrize("case", ["video", "video_photo"])
def test_video_parity_with_transformers(moe_server, hf_moe, tiny_qwen3_5_moe_path, photo_paths, case):
    check_video_case(moe_server[0], tiny_qwen3_5_moe_path, hf_moe, case, photo_paths["rocket"].read_bytes())


def test_chunked_prompt_then_radix_hit_equal_transformers(moe_server, references, tiny_qwen3_5_moe_path):
    _chunked_then_radix_hit(moe_server[0], tiny_qwen3_5_moe_path, references["long"])


def test_n2_greedy_choices_equal_transformers(moe_server, references, tiny_qwen3_5_moe_path, photo_paths):
    _, ref_ids, ref_text = references["one_photo"]
    resp = _chat(moe_server[0], tiny_qwen3_5_moe_path, _openai_messages(_resolve("one_photo", photo_paths)), n=2)
    assert [(c["index"], c["token_ids"], c["message"]["content"]) for c in resp["choices"]] == \
        [(0, ref_ids, ref_text), (1, ref_ids, ref_text)]
    assert resp["usage"]["completion_tokens"] == 2 * NEW_TOKENS


def test_tp2_equals_transformers(references, hf_moe, tiny_qwen3_5_moe_path, photo_paths, tmp_path_factory):
    """Prefill and decode at TP=2 (gloo): a photo, a video after a photo, the chunked prompt and its radix hit."""
    model = tiny_qwen3_5_moe_path
    with launched(model, tmp_path_factory.mktemp("q35moe-tp2"), "--device", "cpu", "--prefill-tp", "2",
                  "--decode-tp", "2", *CHUNKED) as (url, _):
        check_parity(url, model, _resolve("one_photo", photo_paths), references["one_photo"])
        check_video_case(url, model, hf_moe, "video_photo", photo_paths["rocket"].read_bytes())
        _chunked_then_radix_hit(url, model, references["long"])
