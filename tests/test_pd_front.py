"""The HTTP fronts' pieces without servers: image token counts from sizes against the processor, the prefill
replies, the input digest, the bootstrap-field checks and the /loads body."""

from __future__ import annotations

import time

import pytest

from epdserve.frontend.errors import APIError, StageError
from epdserve.frontend.image_slots import image_slots
from epdserve.frontend.pd import BootstrapFields, check_bootstrap, loads_body
from epdserve.wire.messages import KVTransfer, Load, PrefillRequest, SamplingParams, input_ids_digest
from epdserve.prefill.replies import PrefillReplies


def test_image_slots_match_the_image_processor(tiny_model_path, photo_paths):
    """The decode front's counts (header size + resize rule) equal the processor's grid on the real photos."""
    from PIL import Image
    from transformers import AutoProcessor

    ip = AutoProcessor.from_pretrained(tiny_model_path).image_processor
    for path in photo_paths.values():
        got = image_slots(ip, path.read_bytes())
        grid = ip(images=[Image.open(path).convert("RGB")], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert got.grid_thw == grid
        assert got.num_tokens == grid[0] * grid[1] * grid[2] // ip.merge_size**2
    with pytest.raises(StageError, match="cannot decode"):
        image_slots(ip, b"not an image")
    wide = Image.new("RGB", (2010, 10))
    import io

    buf = io.BytesIO()
    wide.save(buf, format="PNG")
    with pytest.raises(StageError, match="unsupported image shape"):
        image_slots(ip, buf.getvalue())


def _req(rid: str, room: int, reply: bool = True) -> PrefillRequest:
    return PrefillRequest(rid=rid, input_ids=[1, 2, 3], images=[], sampling=SamplingParams(), bootstrap_room=room,
                          reply=reply)


def test_prefill_replies_answer_once_prefill_is_done():
    replies = PrefillReplies(timeout_s=60)
    replies.track(b"a", _req("r1", 1))
    replies.track(b"b", _req("r2", 2))
    replies.track(b"g", _req("gw", 3, reply=False))  # the epdserve gateway never asks
    replies.track(b"c", _req("r4", 4))
    assert len(replies) == 3
    assert replies.collect({}, []) == []  # nothing done yet
    done = KVTransfer(rid="r1", bootstrap_room=1, first_token_id=42, cached_tokens=16)
    failed = KVTransfer(rid="r2", bootstrap_room=2, error="timed out waiting for image embeddings")
    out = dict(replies.collect({1: (0.0, done)}, [failed]))
    assert out[b"a"].token_ids == [42] and out[b"a"].finish_reason == "length" and out[b"a"].cached_tokens == 16
    assert out[b"a"].prompt_tokens == 3 and out[b"a"].completion_tokens == 1
    assert out[b"b"].finish_reason == "error" and "embeddings" in out[b"b"].error and out[b"b"].token_ids == []
    assert replies.collect({1: (0.0, done)}, []) == []  # once
    replies.forget("r4")
    assert len(replies) == 0
    replies = PrefillReplies(timeout_s=0.01)
    replies.track(b"a", _req("r1", 1))
    time.sleep(0.02)
    assert replies.collect({}, []) == [] and len(replies) == 0  # never done (aborted, expired): forgotten


def test_input_digest_tells_prompts_apart():
    assert input_ids_digest([1, 2, 3]) == input_ids_digest([1, 2, 3])
    assert input_ids_digest([1, 2, 3]) != input_ids_digest([1, 2, 4])
    assert input_ids_digest([1, 2]) != input_ids_digest([1, 2, 0])
    assert len(input_ids_digest([])) == 16


def test_bootstrap_fields_are_required():
    with pytest.raises(APIError, match="bootstrap_room"):
        check_bootstrap("prefill", BootstrapFields())
    check_bootstrap("prefill", BootstrapFields(bootstrap_room=5))  # prefill is the bootstrap server itself
    with pytest.raises(APIError, match="bootstrap port"):
        check_bootstrap("decode", BootstrapFields(bootstrap_room=5, bootstrap_host="h", bootstrap_port=None))
    check_bootstrap("decode", BootstrapFields(bootstrap_room=5, bootstrap_host="h", bootstrap_port=8998))
    f = BootstrapFields.model_validate_json(b'{"model": "m", "bootstrap_room": 9223372036854775807, '
                                            b'"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998}')
    assert f.bootstrap_room == 2**63 - 1
    # n > 1: a router sends one entry per sample; the choices share one prefill, so both legs take the first room.
    f = BootstrapFields.model_validate_json(b'{"n": 2, "bootstrap_room": [7, 8], "bootstrap_host": ["h", "h"], '
                                            b'"bootstrap_port": [8998, 8998]}')
    assert (f.bootstrap_room, f.bootstrap_host, f.bootstrap_port) == (7, "h", 8998)


def test_loads_body_is_sglang_shaped():
    load = Load(role="prefill", num_running_reqs=2, num_waiting_reqs=1, kv_pages_used=30, kv_pages_total=100,
                kv_pages_cached=10, rooms=3, embeddings=1)
    body = loads_body(load, page_size=16)
    rank = body["loads"][0]
    assert body["dp_rank_count"] == 1 and rank["dp_rank"] == 0
    assert rank["num_running_reqs"] == 2 and rank["num_waiting_reqs"] == 1 and rank["num_total_reqs"] == 3
    assert rank["num_used_tokens"] == 20 * 16 and rank["max_total_num_tokens"] == 1600
    assert rank["token_usage"] == pytest.approx(0.2)  # evictable radix-cache pages are not load
    assert rank["rooms"] == 3 and rank["embeddings"] == 1 and rank["kv_pages_cached"] == 10
