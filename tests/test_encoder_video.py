"""Videos through the encoder: gRPC Encode of a clip equals transformers' ``get_video_features`` on the processor's
own frame sampling (Qwen2.5-VL and Qwen3-VL, whose DeepStack levels are extra columns), the cache, the push to
prefill, bad videos as INVALID_ARGUMENT, and the gateway's client and encoder pool."""

from __future__ import annotations

import asyncio
import hashlib
import io

import grpc
import pytest
import torch
import zmq
from PIL import Image

from epdserve.encoder.grpc_codec import tensor_from_proto
from epdserve.hashing import video_key
from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from epdserve.video import VideoError, VideoLimits, probe_video
from epdserve.wire.messages import ImageEmbeddings, decode
from test_encoder import _CHANNEL_OPTIONS, ServerThread
from test_video import all_frames, audio_only, make_clip

av = pytest.importorskip("av")

MAX_FRAMES, MAX_DURATION_S = 16, 5.0
CLIP = make_clip(frames=24, fps=8, size=(96, 64))  # 3 s, non-square
# Default sampling (2 fps: 6 frames), an fps override (12 frames) and a num_frames override (4): three grids.
SAMPLINGS = [(None, None), (4.0, None), (None, 4)]


@pytest.fixture(scope="module")
def tiny_qwen3_vl_path(tmp_path_factory) -> str:
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-vl-video"), arch="qwen3_vl"))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family(request, tiny_model_path, tiny_qwen3_vl_path):
    """``(model_type, model_path, stub)`` of an encoder serving the family's tiny checkpoint with small video
    limits."""
    path = tiny_model_path if request.param == "qwen2_5_vl" else tiny_qwen3_vl_path
    srv = ServerThread(path, max_video_frames=MAX_FRAMES, max_video_duration_s=MAX_DURATION_S).start()
    with grpc.insecure_channel(srv.address, options=_CHANNEL_OPTIONS) as channel:
        yield request.param, path, encoder_pb2_grpc.EncoderStub(channel)
    srv.stop()


def _request(rid: str, videos: list[tuple[bytes, float | None, int | None]], images: list[bytes] = (),
             targets: list[str] = ()) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(
        request_id=rid, images=[encoder_pb2.Image(data=d) for d in images], targets=list(targets),
        videos=[encoder_pb2.Video(data=d, fps=fps or 0, num_frames=n or 0) for d, fps, n in videos])


def _hf_video(path: str, data: bytes, fps: float | None, num_frames: int | None) -> tuple[list[int], torch.Tensor]:
    """transformers' own pipeline on the whole decoded clip: the video processor samples the frames itself (at
    ``fps`` or ``num_frames``; neither: the processor's fps, else 2, as ``frame_sampler`` documents), then
    ``get_video_features``; Qwen3-VL's DeepStack levels appended as columns."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from epdserve.models.video_layout import DEFAULT_FPS

    processor = AutoProcessor.from_pretrained(path).video_processor
    if fps is None and num_frames is None:
        fps = getattr(processor, "fps", None) or DEFAULT_FPS
    # Both given, one None: Qwen3-VL's processor has an fps of its own that num_frames must replace.
    inputs = processor(videos=[all_frames(data)], video_metadata=[probe_video(data)], do_sample_frames=True,
                       fps=fps, num_frames=num_frames, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    ref = out.pooler_output[0]
    if getattr(out, "deepstack_features", None):
        # One video: a level is that video's rows (transformers 5.17) or a one-video split of them (>= 5.18).
        ref = torch.cat([ref, *(level if torch.is_tensor(level) else level[0] for level in out.deepstack_features)],
                        dim=-1)
    return inputs["video_grid_thw"][0].tolist(), ref


@pytest.mark.parametrize("fps,num_frames", SAMPLINGS)
def test_video_embedding_equals_transformers(family, fps, num_frames):
    _, path, stub = family
    response = stub.Encode(_request(f"v-{fps}-{num_frames}", [(CLIP, fps, num_frames)]), timeout=120)
    assert len(response.images) == 0 and len(response.videos) == 1
    [result] = response.videos
    grid, ref = _hf_video(path, CLIP, fps, num_frames)
    assert result.image_hash == video_key(CLIP, fps, num_frames)
    assert list(result.grid_thw) == grid and grid[0] > 1  # several temporal patches
    emb = tensor_from_proto(result.embedding)
    info = stub.GetModelInfo(encoder_pb2.GetModelInfoRequest(), timeout=10)
    assert emb.shape == ref.shape == (result.num_tokens, info.out_hidden_size * (1 + info.num_deepstack_levels))
    assert result.num_tokens == grid[0] * grid[1] * grid[2] // info.spatial_merge_size ** 2
    assert emb.dtype == torch.float32 and emb.is_contiguous()
    torch.testing.assert_close(emb, ref, atol=1e-5, rtol=0)


def test_qwen3_vl_reports_its_deepstack_levels(tiny_qwen3_vl_path, family):
    from transformers import AutoConfig

    _, path, stub = family
    levels = len(getattr(AutoConfig.from_pretrained(path).vision_config, "deepstack_visual_indexes", None) or ())
    assert stub.GetModelInfo(encoder_pb2.GetModelInfoRequest(), timeout=10).num_deepstack_levels == levels
    assert (levels > 0) == (path == tiny_qwen3_vl_path)


def test_second_call_is_a_cache_hit_and_sampling_is_part_of_the_key(family):
    _, _, stub = family
    clip = make_clip(frames=24, fps=8, size=(96, 64), seed=7)
    first = stub.Encode(_request("c1", [(clip, None, None), (clip, None, None)]), timeout=120)
    assert [r.cache_hit for r in first.videos] == [False, False]  # one encode for both copies
    second = stub.Encode(_request("c2", [(clip, None, None)]), timeout=120)
    assert second.videos[0].cache_hit and second.videos[0].embedding.data == first.videos[0].embedding.data
    other = stub.Encode(_request("c3", [(clip, None, 4)]), timeout=120)
    assert not other.videos[0].cache_hit and other.videos[0].image_hash != first.videos[0].image_hash
    load = stub.GetLoad(encoder_pb2.EncoderLoadRequest(), timeout=10)
    assert load.num_videos_encoding == 0 and load.num_images_encoding == 0


def test_push_carries_images_then_videos_by_key(family, photo_paths):
    _, _, stub = family
    image = photo_paths["chelsea"].read_bytes()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        pull.bind("tcp://127.0.0.1:*")
        endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        pushed = stub.Encode(_request("push-v", [(CLIP, None, 4)], [image], [endpoint]), timeout=120)
        assert pull.poll(20_000), "the target got no embeddings"
        msg = decode(pull.recv_multipart())
    finally:
        pull.close(linger=0)
        ctx.term()
    assert not pushed.videos[0].HasField("embedding") and not pushed.images[0].HasField("embedding")
    alone = stub.Encode(_request("alone-v", [(CLIP, None, 4)], [image]), timeout=120)
    assert isinstance(msg, ImageEmbeddings) and msg.rid == "push-v"
    assert msg.image_hashes == [hashlib.sha256(image).hexdigest(), video_key(CLIP, None, 4)]
    for emb, result in zip(msg.embeddings, [*alone.images, *alone.videos]):
        assert torch.equal(emb, tensor_from_proto(result.embedding))


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _no_frames() -> bytes:
    """An MP4 with a video stream and no frame (FFmpeg cannot open it: no codec parameters were written)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
    return buf.getvalue()


# Where the families differ, transformers' own processors do: Qwen2-VL's sample_frames divides by zero on a still
# image at 2 fps and refuses more frames than the clip has; Qwen3-VL's samples one frame of the image (its resize
# then refuses fewer frames than temporal_patch_size) and repeats frames to reach num_frames.
BAD = {
    "random bytes": ((bytes(range(256)) * 40, None, None), "cannot read the video"),
    "png": ((_png(), None, None), {"qwen2_5_vl": "the video (1 frame(s) at 25 fps) is too short for one frame",
                                   "qwen3_vl": "the video processor refuses 1 frame(s) of 96x64"}),
    "empty mp4": ((_no_frames(), None, None), "cannot read the video"),
    "audio only": ((audio_only(), None, None), "the file has no video stream"),
    "too many frames": ((CLIP, 8.0, None), f"24 frames sampled from the video, over the limit of {MAX_FRAMES}"),
    "too long": ((make_clip(frames=48, fps=8), None, None),
                 f"the video lasts 6.0 s, over the limit of {MAX_DURATION_S:g} s"),
    "more frames than it has": ((CLIP, None, 40), {
        "qwen2_5_vl": "cannot sample the video's frames",
        "qwen3_vl": f"40 frames sampled from the video, over the limit of {MAX_FRAMES}"}),
    "fps and num_frames": ((CLIP, 2.0, 4), "give fps or num_frames, not both"),
    "negative fps": ((CLIP, -1.0, None), "fps and num_frames must be positive"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_video_is_invalid_argument_and_the_server_keeps_serving(family, kind):
    model_type, _, stub = family
    video, message = BAD[kind]
    message = "video 0: " + (message[model_type] if isinstance(message, dict) else message)
    with pytest.raises(grpc.RpcError) as err:
        stub.Encode(_request(f"bad-{kind}", [(CLIP, None, 4), video]), timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The good video comes first: the message names the bad one by its index.
    assert message.replace("video 0", "video 1") in err.value.details(), err.value.details()
    ok = stub.Encode(_request(f"ok-after-{kind}", [(CLIP, None, None)]), timeout=120)
    assert ok.videos[0].num_tokens > 0


def test_frame_size_limit_is_checked_before_decoding(tiny_model_path):
    from transformers import AutoProcessor

    from epdserve.encoder.video import decode_video

    vp = AutoProcessor.from_pretrained(tiny_model_path).video_processor
    with pytest.raises(VideoError, match="96x64 pixels are larger than the limit of 6143"):
        decode_video(vp, CLIP, None, None, VideoLimits(), max_frame_pixels=96 * 64 - 1)
    video = decode_video(vp, CLIP, None, 4, VideoLimits(), max_frame_pixels=96 * 64)
    assert video.frames.shape == (4, 64, 96, 3) and video.patches == video.grid_thw[0] * video.grid_thw[1] * \
        video.grid_thw[2]


# ------------------------------------------------------------------------------------ gateway client and pool


@pytest.fixture(scope="module")
def two_encoders(tiny_model_path):
    servers = [ServerThread(tiny_model_path).start() for _ in range(2)]
    yield [s.address for s in servers]
    for s in servers:
        s.stop()


def test_grpc_client_returns_images_then_videos(two_encoders, photo_paths):
    from epdserve.frontend.encoder_client import GrpcEncoderClient
    from epdserve.frontend.prompt import VideoInput

    image = photo_paths["rocket"].read_bytes()
    videos = [VideoInput(CLIP), VideoInput(CLIP, num_frames=4)]

    async def run():
        client = GrpcEncoderClient(two_encoders[0])
        try:
            return await client.encode("gc", [image], [], videos=videos)
        finally:
            await client.close()

    out = asyncio.run(run())
    assert [e.image_hash for e in out] == [hashlib.sha256(image).hexdigest(), video_key(CLIP), video_key(CLIP, None, 4)]
    assert out[1].grid_thw != out[2].grid_thw
    for e in out[1:]:
        t, h, w = e.grid_thw
        assert e.num_tokens == t * h * w // 4 and t > 1


def test_pool_routes_videos_by_key_across_two_encoders(two_encoders):
    from epdserve.frontend.encoder_client import GrpcEncoderClient
    from epdserve.frontend.encoders import EncoderPool, rendezvous_order
    from epdserve.frontend.prompt import VideoInput

    clips = [make_clip(frames=8, fps=8, size=(64, 48), seed=100 + i) for i in range(8)]
    videos = [VideoInput(c, num_frames=2) for c in clips]

    async def run():
        clients = [GrpcEncoderClient(a) for a in two_encoders]
        pool = EncoderPool(clients)
        await pool.wait_ready(30)
        before = [(await c.load())["cached_embeddings"] for c in clients]
        out = await pool.encode("pool-v", [], [], videos=videos)
        after = [(await c.load())["cached_embeddings"] for c in clients]
        await pool.close()
        return pool.names, out, [a - b for a, b in zip(after, before)]

    names, out, new_entries = asyncio.run(run())
    keys = [video_key(c, None, 2) for c in clips]
    assert [e.image_hash for e in out] == keys
    tops = [rendezvous_order(bytes.fromhex(k), names)[0] for k in keys]
    assert new_entries == [tops.count(0), tops.count(1)] and 0 not in new_entries  # both got videos, by key


def test_pool_fails_videos_over_like_images():
    """A down encoder's videos are retried on their next choice, and each encoder gets its videos in its call."""
    from epdserve.frontend.encoders import EncoderPool, rendezvous_order
    from epdserve.frontend.errors import StageError
    from epdserve.frontend.prompt import EncodedImage, VideoInput

    class Fake:
        def __init__(self, addr):
            self.addr, self.down, self.calls = addr, False, []

        async def encode(self, rid, images, targets, videos=()):
            self.calls.append((list(images), list(videos)))
            if self.down:
                raise StageError(f"encoder {self.addr} unavailable", 503)
            return ([EncodedImage(hashlib.sha256(d).hexdigest(), 1, [1, 2, 2]) for d in images]
                    + [EncodedImage(video_key(v.data, v.fps, v.num_frames), 2, [2, 2, 2]) for v in videos])

        async def serving(self):
            return not self.down

        async def wait_ready(self, timeout_s):
            pass

        async def close(self):
            pass

    videos = [VideoInput(b"clip%d" % i, fps=2.0) for i in range(12)]
    images = [b"img%d" % i for i in range(6)]

    async def run():
        a, b = Fake("a:1"), Fake("b:2")
        pool = EncoderPool([a, b], probe_interval_s=60)
        first = await pool.encode("r1", images, [], videos=videos)
        routed = {e.addr: [v.data for _, vs in e.calls for v in vs] for e in (a, b)}
        a.down, a.calls, b.calls = True, [], []
        second = await pool.encode("r2", images, [], videos=videos)
        await pool.close()
        return pool.names, first, second, routed, b.calls

    names, first, second, routed, b_calls = asyncio.run(run())
    want = [hashlib.sha256(d).hexdigest() for d in images] + [video_key(v.data, 2.0) for v in videos]
    assert [e.image_hash for e in first] == want and [e.image_hash for e in second] == want
    for v in videos:
        top = names[rendezvous_order(bytes.fromhex(video_key(v.data, 2.0)), names)[0]]
        assert v.data in routed[top]
    assert routed["a:1"] and routed["b:2"]
    assert sorted(v.data for _, vs in b_calls for v in vs) == sorted(v.data for v in videos)


def test_video_tower_calls_never_overlap_image_batches(tiny_model_path, photo_paths):
    """Concurrent requests with images and videos: every tower call (a video's too) runs on the batcher's one
    tower thread, one at a time, and each video is a call of its own."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import zmq.asyncio

    from epdserve.encoder.batcher import EncodeBatcher
    from epdserve.encoder.cache import EmbeddingCache
    from epdserve.encoder.pusher import EmbeddingPusher
    from epdserve.encoder.server import EncoderServicer
    from epdserve.encoder.vision import VisionEncoder

    encoder = VisionEncoder(tiny_model_path, "cpu", "float32")
    run_tower, state, lock = encoder.run_tower, {"now": 0, "most": 0, "rows": []}, threading.Lock()

    def watched(prepared):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["rows"].append(len(prepared.rows))
        time.sleep(0.05)  # long enough for a second tower call to overlap, were one allowed
        try:
            return run_tower(prepared)
        finally:
            with lock:
                state["now"] -= 1

    encoder.run_tower = watched

    class Context:
        async def abort(self, code, message):
            raise AssertionError(f"{code}: {message}")

    photos = [photo_paths[n].read_bytes() for n in ("chelsea", "rocket", "coffee")]
    clips = [make_clip(frames=16, fps=8, size=(64, 48), seed=200 + i) for i in range(3)]

    async def run():
        tower, ctx = ThreadPoolExecutor(1), zmq.asyncio.Context()
        servicer = EncoderServicer(EmbeddingCache(64 << 20), EmbeddingPusher(ctx), EncodeBatcher(tower), 4_000_000)
        servicer.encoder = encoder
        requests = [_request(f"mix{i}", [(clips[i], None, None)], [photos[i]]) for i in range(3)]
        out = await asyncio.gather(*(servicer.Encode(r, Context()) for r in requests))
        tower.shutdown()
        ctx.term()
        return out

    out = asyncio.run(run())
    assert all(len(r.images) == 1 and len(r.videos) == 1 for r in out)
    assert state["most"] == 1, "two tower calls overlapped"
    # 3 videos alone, the 3 images in 1 to 3 batches
    assert state["rows"].count(1) >= 3 and sum(state["rows"]) == 6
