"""Videos at the front and in prefill: the front's prompt ids and spans (planned from the video's metadata alone)
equal transformers' processor output and ``get_rope_index``; prefill fed transformers' own ``get_video_features``
rows through those spans gives transformers' logits and greedy tokens; bad videos are 400s that leave the gateway
serving."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest
import torch
from test_video import audio_only, make_clip, xfail_if_reference_truncates_time
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from epdserve.frontend.image_slots import image_slots
from epdserve.frontend.media import MediaPolicy
from epdserve.frontend.openai.chat import to_hf_messages
from epdserve.frontend.openai.protocol import ChatCompletionRequest
from epdserve.frontend.prompt import PromptBuilder
from epdserve.frontend.request_media import fetch_media
from epdserve.hashing import video_key
from epdserve.models.mrope import mrope_positions
from epdserve.models.video_layout import DEFAULT_FPS
from epdserve.video import VideoLimits, probe_video

av = pytest.importorskip("av")

CLIP = dict(frames=24, fps=8, size=(112, 84))  # 3 s; 6 frames at 2 fps: 3 temporal patches
KWARGS = [None, {"fps": 4.0}, {"num_frames": 4}]


def _path(request, family: str) -> str:
    name = {"qwen2_vl": "tiny_qwen2_vl_path", "qwen2_5_vl": "tiny_model_path", "qwen3_vl": "tiny_qwen3_vl_path"}[family]
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
    if family == "qwen2_5_vl":
        xfail_if_reference_truncates_time(family, ref["second_per_grid_ts"])
    extra = {"second_per_grid_ts": ref["second_per_grid_ts"]} if family == "qwen2_5_vl" else {}
    want, want_delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                  ref.get("image_grid_thw"), ref["video_grid_thw"], **extra)
    pos, delta = mrope_positions(len(ids), [(s.offset, s.grid_thw, s.time_interval) for s in prompt.images],
                                 config.vision_config.spatial_merge_size)
    assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)


# ---------------------------------------------------------------- prefill and decode against transformers


def video_rows(model, inputs) -> torch.Tensor:
    """transformers' ``get_video_features`` rows of the prompt's videos as the encoder sends them: ``[N,
    embed_width]``, Qwen3-VL's DeepStack levels as extra columns after the embedding (vLLM's layout)."""
    def rows(x):
        return x if torch.is_tensor(x) else torch.cat(list(x))

    with torch.no_grad():
        out = model.model.get_video_features(pixel_values_videos=inputs["pixel_values_videos"],
                                             video_grid_thw=inputs["video_grid_thw"])
    levels = [rows(level) for level in getattr(out, "deepstack_features", None) or []]
    return torch.cat([rows(out.pooler_output), *levels], dim=-1)


def hf_video_inputs(processor, messages, clip: bytes):
    from epdserve.models.video_layout import frame_sampler
    from epdserve.video import load_video

    hf, _, _ = to_hf_messages(ChatCompletionRequest.model_validate({"model": "m", "messages": messages}).messages)
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    frames, meta = load_video(clip, frame_sampler(processor.video_processor))
    return processor(text=[text], videos=[frames], video_metadata=[meta], do_sample_frames=False,
                     return_tensors="pt")


@pytest.mark.parametrize("family,chunked", [("qwen2_5_vl", False), ("qwen3_vl", False), ("qwen3_vl", True)])
def test_prefill_and_decode_equal_transformers_generate(request, family, chunked):
    """The front's prompt and spans, prefilled by the prefill scheduler from transformers' own video rows (one
    ``ImageEmbeddings`` under the video's key) and decoded by the decode scheduler: the first token's
    log-probabilities and the greedy tokens equal transformers' forward and ``generate()``. ``chunked``: a chunk
    boundary falls inside a later temporal patch of a Qwen3-VL video (rows from a nonzero ``embed_offset``)."""
    from test_schedulers import _decode_sched, _decode_tokens

    from epdserve.engine.model_runner import ModelRunner
    from epdserve.prefill.scheduler import PrefillScheduler
    from epdserve.wire.messages import DecodeRequest, ImageEmbeddings, PrefillRequest, SamplingParams

    path, clip, steps, top = _path(request, family), make_clip(**CLIP), 6, 5
    messages = conversation("one", [clip], None)
    prompt, media, _ = front_prompt(path, messages, None)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = hf_video_inputs(AutoProcessor.from_pretrained(path), messages, clip)
    assert prompt.input_ids == inputs["input_ids"][0].tolist()
    spans, n = prompt.images, len(prompt.input_ids)
    chunk = 0
    if chunked:
        later = next(s for s in spans if s.embed_offset > 0)
        chunk = later.offset + later.length // 2  # the first boundary: inside the second temporal patch
        assert len(spans) > 2 and chunk < n

    def runner():
        return ModelRunner(path, device=torch.device("cpu"), dtype=torch.float32, num_pages=128, page_size=4,
                           attention_backend="sdpa")

    prefill = PrefillScheduler(runner(), context_length=4096, max_prefill_tokens=8192, timeout_s=60,
                               chunked_prefill_size=chunk)
    dec = _decode_sched(runner())
    sampling = SamplingParams(temperature=0, max_new_tokens=steps, logprobs=top)
    _, reg = dec.add_request(DecodeRequest(rid="v", prompt_len=n, sampling=sampling, bootstrap_host="h",
                                           bootstrap_port=1, bootstrap_room=3), peer=b"g")
    prefill.add_request(PrefillRequest(rid="v", input_ids=prompt.input_ids, images=spans, sampling=sampling,
                                       bootstrap_room=3))
    rows = video_rows(model, inputs)
    prefill.add_embeddings(ImageEmbeddings(rid="v", image_hashes=[media.videos[0].encoded.image_hash],
                                           embeddings=[rows]))
    prefill.register(reg)
    forwards, sent = 0, []
    while not sent and forwards < 50:
        sent, forwards = prefill.step(), forwards + 1
    ((_, transfer),) = sent
    assert transfer.error is None
    assert forwards >= (2 if chunked else 1)
    dec.add_transfer(transfer)
    tokens, _ = _decode_tokens(dec, 3)

    with torch.no_grad():
        want_lp = torch.log_softmax(model(**inputs).logits[0, -1], -1)
        want = model.generate(**inputs, max_new_tokens=steps, do_sample=False)[0, n:].tolist()
    got_ids = [int(t) for t, _ in transfer.first_logprob.top]
    assert got_ids == want_lp.topk(top).indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in transfer.first_logprob.top]), want_lp[got_ids],
                               atol=1e-4, rtol=1e-4)
    assert transfer.first_token_id == want[0] and tokens == want


# ---------------------------------------------------------------- through the gateway app (fake stages)


class VideoEncoder:
    """test_gateway's fake encoder, also taking videos: each decoded and sized by transformers' video processor
    (not by the front's plan, which its answer is checked against)."""

    def __init__(self, processor):
        from test_gateway import FakeEncoder

        self.images = FakeEncoder(processor)
        self.vp = processor.video_processor
        self.videos: list[list] = []
        self.extra_tokens = 0

    async def encode(self, rid, images, targets, videos=()):
        self.videos.append(list(videos))
        out = await self.images.encode(rid, images, targets)
        return out + [await asyncio.to_thread(self._video, v) for v in videos]

    def _video(self, v):
        from epdserve.frontend.errors import StageError
        from epdserve.frontend.prompt import EncodedImage
        from epdserve.models.video_layout import frame_sampler
        from epdserve.video import VideoError, load_video

        try:
            frames, meta = load_video(v.data, frame_sampler(self.vp, v.fps, v.num_frames))
        except VideoError as e:
            raise StageError(str(e), 400) from None
        grid = self.vp(videos=[frames], video_metadata=[meta], do_sample_frames=False,
                       return_tensors="pt")["video_grid_thw"][0].tolist()
        tokens = grid[0] * grid[1] * grid[2] // self.vp.merge_size**2 + self.extra_tokens
        return EncodedImage(video_key(v.data, v.fps, v.num_frames), tokens, grid)

    async def close(self):
        pass


@pytest.fixture(scope="module")
def video_gateway(tiny_model_path):
    """(base URL, prefill, decode, encoder) of a gateway on fake stages, videos limited to 8 frames and 5 s."""
    from test_gateway import FakeStage, StageClient, running_gateway

    from epdserve.config import GatewayConfig

    prefill, decode_ = FakeStage("prefill"), FakeStage("decode")
    config = GatewayConfig(model_path=tiny_model_path, prefill_addr=prefill.addr, decode_addr=decode_.addr,
                           max_video_frames=8, max_video_duration_s=5.0)
    encoder = VideoEncoder(AutoProcessor.from_pretrained(tiny_model_path))
    try:
        with running_gateway(config, StageClient(config, encoder=encoder)) as base:
            yield base, prefill, decode_, encoder
    finally:
        prefill.stop()
        decode_.stop()


def _post(base, model, content, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_completion_tokens": 3, **kw}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def _video_part(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def _prefill_requests(prefill):
    from epdserve.wire.messages import PrefillRequest

    return prefill.messages(PrefillRequest)


def _good(base, model, prefill, encoder, photo: bytes):
    """A photo + video request that must succeed; returns its PrefillRequest."""
    clip = make_clip(**CLIP)
    before = len(_prefill_requests(prefill))
    r = _post(base, model, [{"type": "image_url", "image_url": {"url": data_url(photo, "image/jpeg")}},
                            _video_part(clip), {"type": "text", "text": "and?"}], mm_processor_kwargs={"fps": 2})
    assert r.status_code == 200, r.text
    assert [v.data for v in encoder.videos[-1]] == [clip] and encoder.videos[-1][0].fps == 2.0
    for _ in range(100):
        if len(_prefill_requests(prefill)) > before:
            break
        time.sleep(0.05)
    req = _prefill_requests(prefill)[-1]
    assert {s.image_hash for s in req.images if s.video} == {video_key(clip, 2.0)}
    return req


BAD = {  # name: (video part, mm_processor_kwargs, words the 400's message must have)
    "corrupt": (lambda: _video_part(b"\x00\x00\x00\x18ftypmp42" + bytes(300)), None, "cannot read the video"),
    "no_video_stream": (lambda: _video_part(audio_only(), "application/octet-stream"), None, "no video stream"),
    "too_many_frames": (lambda: _video_part(make_clip(**CLIP)), {"num_frames": 12}, "over the limit of 8"),
    "too_long": (lambda: _video_part(make_clip(frames=60, fps=10)), {"fps": 0.5}, "over the limit of 5 s"),
    "not_a_video_type": (lambda: _video_part(make_clip(**CLIP), "text/plain"), None, "expected video/*"),
    "more_frames_than_the_clip": (lambda: _video_part(make_clip(**CLIP)), {"num_frames": 40}, "cannot sample"),
    "both_kwargs": (lambda: _video_part(make_clip(**CLIP)), {"fps": 1, "num_frames": 4}, "not both"),
    "unknown_kwarg": (lambda: _video_part(make_clip(**CLIP)), {"max_pixels": 1000}, "max_pixels"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_is_400_before_the_encoder_and_the_gateway_keeps_serving(video_gateway, tiny_model_path,
                                                                             photo_paths, name):
    base, prefill, _, encoder = video_gateway
    part, kwargs, words = BAD[name]
    calls = len(encoder.videos)
    r = _post(base, tiny_model_path, [part(), {"type": "text", "text": "what?"}],
              **({"mm_processor_kwargs": kwargs} if kwargs else {}))
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert len(encoder.videos) == calls  # refused before any encoder saw it
    _good(base, tiny_model_path, prefill, encoder, photo_paths["chelsea"].read_bytes())


def test_video_request_spans_reach_prefill_and_a_wrong_encoder_count_is_500(video_gateway, tiny_model_path,
                                                                            photo_paths):
    base, prefill, _, encoder = video_gateway
    req = _good(base, tiny_model_path, prefill, encoder, photo_paths["chelsea"].read_bytes())
    kinds = [s.video for s in req.images]
    assert kinds == [False, True]  # the photo, then the video's one span (Qwen2.5-VL)
    video = req.images[1]
    assert video.time_interval != 1.0 and video.embed_offset == 0
    encoder.extra_tokens = 4  # an encoder serving another checkpoint
    try:
        r = _post(base, tiny_model_path, [_video_part(make_clip(**CLIP)), {"type": "text", "text": "?"}])
        assert r.status_code == 500 and "the gateway expected" in r.json()["error"]["message"]
    finally:
        encoder.extra_tokens = 0
    _good(base, tiny_model_path, prefill, encoder, photo_paths["chelsea"].read_bytes())


def test_pd_fronts_build_the_same_video_prompt_and_only_prefill_encodes(tiny_model_path, photo_paths):
    """The decode front (no encoder) lays a photo + video request out from the headers alone, exactly as the
    prefill front does; the prefill front's encode passes the video (with its sampling) to its encoder."""
    from types import SimpleNamespace

    from epdserve.decode.http_front import DecodeFrontStages
    from epdserve.frontend.chat import ChatService
    from epdserve.frontend.openai.chat import ChatCompletion
    from epdserve.prefill.http_front import PrefillFrontStages
    from epdserve.wire.messages import ServerInfo

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    encoder = VideoEncoder(processor)
    info = ServerInfo(role="x", model_path="", context_length=4096, page_size=16, num_pages=64,
                      embed_endpoints=["tcp://127.0.0.1:1"], bootstrap_host="127.0.0.1", bootstrap_port=2)
    fronts = {"prefill": PrefillFrontStages(None, SimpleNamespace(info=info), encoder=encoder),
              "decode": DecodeFrontStages(None, SimpleNamespace(info=info))}
    clip, photo = make_clip(**CLIP), photo_paths["coffee"].read_bytes()
    req = ChatCompletionRequest.model_validate({"model": "m", "mm_processor_kwargs": {"num_frames": 4}, "messages": [
        {"role": "user", "content": [_video_part(clip), {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": data_url(photo, "image/jpeg")}}]}]})
    builder = PromptBuilder.from_pretrained(tiny_model_path)

    async def prepare(stages):
        chat = ChatService(stages, builder, "m", MediaPolicy(max_bytes=10**8))
        try:
            return await ChatCompletion(chat, "r", req).prepare()
        finally:
            chat.close()

    prepared = {role: asyncio.run(prepare(stages)) for role, stages in fronts.items()}
    assert prepared["prefill"].prompt.input_ids == prepared["decode"].prompt.input_ids
    assert prepared["prefill"].prompt.images == prepared["decode"].prompt.images
    assert [s.video for s in prepared["decode"].prompt.images] == [True, False]  # prompt order: video, photo
    (sent,) = encoder.videos
    assert [(v.data, v.fps, v.num_frames) for v in sent] == [(clip, None, 4)]


def test_mm_sources_name_the_absolute_rows_tp_followers_slice(tiny_qwen3_vl_path):
    """A chunk starting inside a later temporal patch of a Qwen3-VL video: ``prefill_batch`` takes that patch's
    rows from its ``embed_offset``, and its ``mm_sources`` let a TP follower gather exactly those rows from its own
    copy (``TPFollower.handle``: ``embeds[rid][hash][start:end]``)."""
    from epdserve.kvcache.page_pool import PagePool
    from epdserve.prefill.records import PrefillRecord, RecordState, prefill_batch
    from epdserve.wire.messages import PrefillRequest, SamplingParams

    messages = conversation("one", [make_clip(**CLIP)], None)
    prompt, media, _ = front_prompt(tiny_qwen3_vl_path, messages, None)
    key, n = media.videos[0].encoded.image_hash, len(prompt.input_ids)
    rows = torch.randn(media.videos[0].encoded.num_tokens, 8)
    pool = PagePool(64, 4)
    rec = PrefillRecord(rid="r", room=1, state=RecordState.RUNNING, deadline=0.0, embeds={key: rows},
                        msg=PrefillRequest(rid="r", input_ids=prompt.input_ids, images=prompt.images,
                                           sampling=SamplingParams(), bootstrap_room=1),
                        pages=pool.alloc(pool.pages_for(n)))
    rec.positions = torch.zeros(3, n, dtype=torch.int64)
    second = prompt.images[1]
    start = second.offset + 3
    batch = prefill_batch([rec], [(start, n)], pool)
    follower = torch.cat([{"r": {key: rows}}[rid][h][s:e] for rid, h, s, e in batch.mm_sources])
    assert torch.equal(batch.mm_embeds, follower)
    assert batch.mm_embeds.shape[0] == int(batch.mm_mask.sum()) == rows.shape[0] - second.embed_offset - 3
    assert torch.equal(batch.mm_embeds[0], rows[second.embed_offset + 3])
