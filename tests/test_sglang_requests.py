"""SGLang scheduler gRPC requests (smg's grpc:// workers) turned into stage requests, without servers: sampling
parameters, the bootstrap fields, and every refusal (INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio

import pytest

from epdserve.frontend.grpc_tensor import InvalidRequest
from epdserve.frontend.scheduler_requests import sampling_params
from epdserve.frontend.sglang.requests import build_leg, image_spans

_proto = pytest.importorskip("smg_grpc_proto")  # its generated modules load as attributes
pb = _proto.sglang_scheduler_pb2

VOCAB, CONTEXT, IMAGE = 1000, 64, 900


def _sp(**kw):
    base = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
    return pb.SamplingParams(**{**base, **kw})


def _run(coro):
    return asyncio.run(coro)


def test_sampling_params_map_onto_the_stages():
    sp = _run(sampling_params(_sp(top_k=0, top_p=0, stop_token_ids=[5], ignore_eos=True, frequency_penalty=0.5,
                                  logit_bias={"7": -2.0}), prompt_len=10, context_length=CONTEXT, vocab_size=VOCAB))
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.0, -1, 1.0)  # proto3's 0 = off
    assert sp.max_new_tokens == CONTEXT - 10  # unset: the rest of the context
    assert sp.stop_token_ids == [5] and sp.ignore_eos and sp.frequency_penalty == 0.5
    assert sp.logit_bias == [[7, -2.0]] and sp.grammar is None
    sp = _run(sampling_params(_sp(max_new_tokens=3, regex="[ab]+"), 10, CONTEXT, VOCAB))
    assert sp.max_new_tokens == 3 and (sp.grammar.type, sp.grammar.text) == ("regex", "[ab]+")
    sp = _run(sampling_params(_sp(json_schema='{"type": "object"}'), 10, CONTEXT, VOCAB))
    assert sp.grammar.type in ("json_schema", "json_object")


@pytest.mark.parametrize("kw, match", [
    (dict(n=2), "n > 1"), (dict(min_p=0.1), "min_p"), (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(max_new_tokens=60), "context length"), (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={"5000": 1.0}), "logit_bias"), (dict(stop_token_ids=[VOCAB]), "stop token"),
    (dict(regex="("), "regex|parse|error"),
])
def test_sampling_params_refusals(kw, match):
    with pytest.raises(InvalidRequest, match=match):
        _run(sampling_params(_sp(**kw), 10, CONTEXT, VOCAB))


def _req(**kw):
    dp = pb.DisaggregatedParams(bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=1234)
    base = dict(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), sampling_params=_sp(),
                disaggregated_params=dp, stream=True)
    return pb.GenerateRequest(**{**base, **kw})


def _leg(req, role="decode"):
    return _run(build_leg(req, "rid-1", role, context_length=CONTEXT, vocab_size=VOCAB, image_token_id=IMAGE,
                          image_processor=None))


def test_both_legs_share_the_room_and_digest():
    leg = _leg(_req())
    assert leg.prefill.rid == leg.decode.rid == "rid-1" and leg.stream
    assert leg.prefill.bootstrap_room == leg.decode.bootstrap_room == 1234 and leg.prefill.reply
    assert (leg.decode.bootstrap_host, leg.decode.bootstrap_port, leg.decode.prompt_len) == ("10.0.0.1", 8998, 3)
    assert leg.prefill.input_digest == leg.decode.input_digest != ""


@pytest.mark.parametrize("req, role, match", [
    (pb.GenerateRequest(request_id="r"), "prefill", "input_ids"),
    (_req(tokenized=pb.TokenizedInput(input_ids=[VOCAB])), "prefill", "vocabulary"),
    (_req(disaggregated_params=None), "prefill", "disaggregated_params"),
    (_req(disaggregated_params=pb.DisaggregatedParams(bootstrap_room=1)), "decode", "bootstrap_port"),
    (_req(lora_id="a"), "decode", "LoRA"),
    (_req(data_parallel_rank=1), "decode", "data_parallel_rank"),
])
def test_requests_refused(req, role, match):
    with pytest.raises(InvalidRequest, match=match):
        _leg(req, role)


def test_image_inputs_refused_before_any_encoding():
    ids = [1, IMAGE, IMAGE, 2]
    with pytest.raises(InvalidRequest, match="image_data"):
        image_spans(pb.MultimodalInputs(pixel_values=pb.TensorData(data=b"", shape=[0], dtype="float32")), ids,
                    IMAGE, None)
    with pytest.raises(InvalidRequest, match="video"):
        image_spans(pb.MultimodalInputs(video_data=[b"x"]), ids, IMAGE, None)
    with pytest.raises(InvalidRequest, match="mm_placeholders"):
        image_spans(pb.MultimodalInputs(image_data=[b"x"]), ids, IMAGE, None)
    with pytest.raises(InvalidRequest, match="im_token_id"):
        image_spans(pb.MultimodalInputs(image_data=[b"x"], im_token_id=IMAGE + 1), ids, IMAGE, None)
    assert image_spans(pb.MultimodalInputs(), ids, IMAGE, None) == ([], [])


def test_image_spans_check_smg_metadata_against_the_processor(tiny_model_path, photo_paths):
    """Qwen2.5-VL (which smg 1.13 itself cannot send over gRPC): metadata as smg would send it for two photos
    is accepted with the processor's grids; a grid or a run length the processor would not make is refused."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    ip = AutoProcessor.from_pretrained(tiny_model_path).image_processor
    files = [photo_paths[n].read_bytes() for n in ("astronaut", "coffee")]
    grids = ip(images=[Image.open(photo_paths[n]).convert("RGB") for n in ("astronaut", "coffee")],
               return_tensors="np")["image_grid_thw"]
    counts = [int(g.prod()) // ip.merge_size**2 for g in grids]
    ids = [1, *[IMAGE] * counts[0], 2, 3, *[IMAGE] * counts[1], 4]
    runs = [pb.PlaceholderRange(offset=1, length=counts[0]), pb.PlaceholderRange(offset=3 + counts[0],
                                                                                 length=counts[1])]

    def mm(grid=grids, holders=runs):
        t = pb.TensorData(data=np.asarray(grid, "<i8").tobytes(), shape=list(np.shape(grid)), dtype="int64")
        return pb.MultimodalInputs(image_data=files, mm_placeholders=holders, model_specific_tensors={
            "image_grid_thw": t})

    images, spans = image_spans(mm(), ids, IMAGE, ip)
    assert images == files and [s.grid_thw for s in spans] == grids.tolist()
    assert [(s.offset, s.length) for s in spans] == [(r.offset, r.length) for r in runs]
    bad = grids.copy()
    bad[1, 2] += 2
    with pytest.raises(InvalidRequest, match="image 1: the gateway's image_grid_thw"):
        image_spans(mm(bad), ids, IMAGE, ip)
    short = [runs[0], pb.PlaceholderRange(offset=runs[1].offset, length=counts[1] - 1)]
    with pytest.raises(InvalidRequest, match="image 1: .* placeholder tokens"):
        image_spans(mm(holders=short), ids, IMAGE, ip)
    broken = list(ids)
    broken[1] = 9  # the first run no longer holds only image tokens
    with pytest.raises(InvalidRequest, match="image 0: .* is not a run of the image token"):
        image_spans(mm(), broken, IMAGE, ip)
    with pytest.raises(InvalidRequest, match="outside the mm_placeholders"):
        image_spans(mm(), ids + [IMAGE], IMAGE, ip)
