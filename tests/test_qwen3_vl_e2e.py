"""Qwen3-VL through the whole pipeline against transformers' generate() on the same tiny checkpoint.

Greedy output through `epdserve launch` must equal ``generate(do_sample=False)`` token for token (text, one photo,
two photos, a multi-turn chat, a generated video alone and after a photo; streaming and not), with two encoders
(content-hash routing) and with prefill and decode at TP=2 (gloo), and behind smg. DeepStack features cross the
encode -> prefill boundary as extra embedding columns (encoder/vision.py): a model that dropped them, or added them
to the wrong rows, would not match. A radix-cache hit that covers the image reuses its KV (which holds the
DeepStack sums) and must still match.
"""

from __future__ import annotations

import pytest

from conftest import hf_reference_model, launched
from smg_cluster import smg_executable, start_cluster
from test_e2e import CASES, NEW_TOKENS, _chat, _hf_reference, _openai_messages, _resolve, check_parity
from test_video_e2e import check_video_case


@pytest.fixture(scope="module")
def hf3e(tiny_qwen3_vl_path):
    return hf_reference_model(tiny_qwen3_vl_path, "Qwen3VLForConditionalGeneration")


@pytest.fixture(scope="module")
def references(hf3e, photo_paths):
    """Per case, transformers' ``(prompt ids, greedy ids, text)``, computed once for the module."""
    return {case: _hf_reference(hf3e, _resolve(case, photo_paths), NEW_TOKENS) for case in CASES}


LAUNCHES = {
    "two-encoders": dict(args=(), num_encoders=2),
    "tp2": dict(args=("--device", "cpu", "--prefill-tp", "2", "--decode-tp", "2"), num_encoders=1),
}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def q3_server(request, tiny_qwen3_vl_path, tmp_path_factory):
    spec = LAUNCHES[request.param]
    with launched(tiny_qwen3_vl_path, tmp_path_factory.mktemp(request.param), *spec["args"],
                  num_encoders=spec["num_encoders"]) as out:
        yield out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(q3_server, references, tiny_qwen3_vl_path, photo_paths, case):
    url, _ = q3_server
    check_parity(url, tiny_qwen3_vl_path, _resolve(case, photo_paths), references[case])


@pytest.mark.parametrize("case", ["video", "video_photo"])
def test_video_parity_with_transformers(q3_server, hf3e, tiny_qwen3_vl_path, photo_paths, case):
    """A generated clip (timestamp text, one token run per temporal patch, DeepStack rows), alone and after a
    photo."""
    check_video_case(q3_server[0], tiny_qwen3_vl_path, hf3e, case, photo_paths["rocket"].read_bytes())


def test_radix_hit_over_the_image_matches_transformers(q3_server, hf3e, tiny_qwen3_vl_path, photo_paths):
    """A second question about the same photo reuses the first one's KV through the image (no DeepStack rows are
    needed for cached tokens) and still equals transformers."""
    url, _ = q3_server
    photo = photo_paths["coffee"]
    # Shared text after the image, longer than a page, so the page-aligned hit reaches past the image's end.
    shared = "Look at this picture carefully, then answer the question below in one short paragraph. "
    _chat(url, tiny_qwen3_vl_path, _openai_messages([("user", [photo, shared + "What is in this picture?"])]))
    turns = [("user", [photo, shared + "Which colours do you see, and where are they?"])]
    ref_prompt, ref_ids, ref_text = _hf_reference(hf3e, turns, NEW_TOKENS)
    resp = _chat(url, tiny_qwen3_vl_path, _openai_messages(turns))
    pad = hf3e[1].config.image_token_id
    image_end = max(i for i, t in enumerate(ref_prompt) if t == pad) + 1
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end
    assert resp["prompt_token_ids"] == ref_prompt
    assert resp["choices"][0]["token_ids"] == ref_ids and resp["choices"][0]["message"]["content"] == ref_text


@pytest.mark.skipif(smg_executable() is None, reason="smg is not installed")
def test_behind_smg_matches_transformers(references, hf3e, tiny_qwen3_vl_path, photo_paths, tmp_path_factory):
    cluster = start_cluster(tiny_qwen3_vl_path, tmp_path_factory.mktemp("smg-q3"), encoders=1, prefills=1,
                            decodes=1, policy="cache_aware")
    try:
        for case in ("text", "one_photo", "two_photos"):
            ref_prompt, ref_ids, ref_text = references[case]
            resp = _chat(cluster.url, tiny_qwen3_vl_path, _openai_messages(_resolve(case, photo_paths)))
            assert resp["choices"][0]["token_ids"] == ref_ids, case
            assert resp["choices"][0]["message"]["content"] == ref_text, case
        check_video_case(cluster.url, tiny_qwen3_vl_path, hf3e, "video_photo", photo_paths["rocket"].read_bytes())
    finally:
        cluster.stop()
