"""Videos at the front and in prefill: the front's prompt ids and spans (planned from the video's metadata alone)
equal transformers' processor output and ``get_rope_index``; prefill fed transformers' own ``get_video_features``
rows through those spans gives transformers' logits and greedy tokens; bad videos are 400s that leave the gateway
serving."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
import torch
from test_video import make_clip
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from epdserve.frontend.image_slots import image_slots
from epdserve.frontend.media import MediaPolicy
from epdserve.frontend.prompt import PromptBuilder, to_hf_messages
from epdserve.frontend.protocol import ChatCompletionRequest
from epdserve.frontend.request_media import fetch_media
from epdserve.hashing import video_key
from epdserve.models.mrope import mrope_positions
from epdserve.models.video_layout import DEFAULT_FPS
from epdserve.video import VideoLimits, probe_video

av = pytest.importorskip("av")

CLIP = dict(frames=24, fps=8, size=(112, 84))  # 3 s; 6 frames at 2 fps: 3 temporal patches
KWARGS = [None, {"fps": 4.0}, {"num_frames": 4}]


@pytest.fixture(scope="module")
def qwen3_vl_path(tmp_path_factory):
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("q3v-video-prompt"), arch="qwen3_vl"))


def _path(request, family: str) -> str:
    name = {"qwen2_vl": "tiny_qwen2_vl_path", "qwen2_5_vl": "tiny_model_path", "qwen3_vl": "qwen3_vl_path"}[family]
    return request.getfixturevalue(name)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def all_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def conversation(case: str, clips: list[bytes], photo: bytes | None) -> list[dict]:
    """OpenAI messages of one test case: ``one`` video, a ``mixed`` photo + video, or a ``multi``-turn chat with a
    video in each user turn."""
    video = [{"type": "video_url", "video_url": {"url": data_url(c, "video/mp4")}} for c in clips]
    if case == "one":
        return [{"role": "user", "content": [video[0], {"type": "text", "text": "What happens?"}]}]
    if case == "mixed":
        image = {"type": "image_url", "image_url": {"url": data_url(photo, "image/jpeg")}}
        return [{"role": "user", "content": [image, {"type": "text", "text": "and"}, video[0]]}]
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "First:"}, video[0]]},
            {"role": "assistant", "content": "A gradient moves."},
            {"role": "user", "content": [video[1], {"type": "text", "text": "And this one?"}]}]


def front_prompt(path: str, messages: list[dict], kwargs: dict | None):
    """What the front builds (``ChatService.prepare``'s steps, no stages): (prompt, media, the builder)."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "mm_processor_kwargs": kwargs})
    builder = PromptBuilder.from_pretrained(path)
    hf, image_urls, video_urls = to_hf_messages(req.messages)
    media = asyncio.run(fetch_media(image_urls, video_urls, req.mm_processor_kwargs, MediaPolicy(max_bytes=10**8),
                                    None, builder.processor, VideoLimits()))
    images = [image_slots(builder.processor.image_processor, b) for b in media.images]
    return builder.build(hf, images, media.videos), media, builder


def reference(path: str, messages: list[dict], kwargs: dict | None, clips: list[bytes], photo: bytes | None):
    """transformers' processor on the same chat: every frame decoded, sampled by the processor itself."""
    from PIL import Image

    processor = AutoProcessor.from_pretrained(path)
    hf, _, _ = to_hf_messages(ChatCompletionRequest.model_validate({"model": "m", "messages": messages}).messages)
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    # Both named, one None: a processor with a default fps (Qwen3-VL's) must not add it to num_frames.
    sampling = {"fps": None, "num_frames": None} | (kwargs or {
        "fps": getattr(processor.video_processor, "fps", None) or DEFAULT_FPS})
    used = clips if sum(m["role"] == "user" for m in messages) > 1 else clips[:1]
    images = [Image.open(io.BytesIO(photo)).convert("RGB")] if photo and "image_url" in str(messages) else None
    return processor(text=[text], images=images, videos=[all_frames(c) for c in used],
                     video_metadata=[probe_video(c) for c in used], do_sample_frames=True, return_tensors="pt",
                     **sampling)


@pytest.mark.parametrize("kwargs", KWARGS, ids=["default", "fps4", "frames4"])
@pytest.mark.parametrize("case", ["one", "mixed", "multi"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_prompt_ids_and_positions_equal_transformers(request, family, case, kwargs, photo_paths):
    path = _path(request, family)
    clips = [make_clip(**CLIP), make_clip(frames=30, fps=10, size=(64, 96), seed=1)]
    photo = photo_paths["chelsea"].read_bytes() if case == "mixed" else None
    messages = conversation(case, clips, photo)
    prompt, media, builder = front_prompt(path, messages, kwargs)
    ref = reference(path, messages, kwargs, clips, photo)
    assert prompt.input_ids == ref["input_ids"][0].tolist()

    # Spans: one per image, and per video one (Qwen2/2.5-VL) or one per temporal patch (Qwen3-VL), rows in order.
    fps, num_frames = (kwargs or {}).get("fps"), (kwargs or {}).get("num_frames")
    grids = ref["video_grid_thw"].tolist()
    assert [v.encoded.grid_thw for v in media.videos] == grids
    ids = prompt.input_ids
    for span in prompt.images:
        token = builder.video_token_id if span.video else builder.image_token_id
        assert ids[span.offset:span.offset + span.length] == [token] * span.length
    videos = [s for s in prompt.images if s.video]
    for v, (t, h, w) in zip(media.videos, grids):
        mine = [s for s in videos if s.image_hash == video_key(v.input.data, fps, num_frames)]
        assert [s.embed_offset for s in mine] == [sum(x.length for x in mine[:k]) for k in range(len(mine))]
        assert sum(s.length for s in mine) == t * h * w // 4 == v.encoded.num_tokens
        assert len(mine) == (t if family == "qwen3_vl" else 1)
    assert sum(s.length for s in videos) == ids.count(builder.video_token_id)

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForImageTextToText.from_config(config)
    extra = {"second_per_grid_ts": ref["second_per_grid_ts"]} if family == "qwen2_5_vl" else {}
    want, want_delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                  ref.get("image_grid_thw"), ref["video_grid_thw"], **extra)
    pos, delta = mrope_positions(len(ids), [(s.offset, s.grid_thw, s.time_interval) for s in prompt.images],
                                 config.vision_config.spatial_merge_size)
    assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)
