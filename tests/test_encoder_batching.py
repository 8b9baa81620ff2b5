"""Cross-request batching in the encoder: concurrent requests share tower calls and each gets its own rows."""

from __future__ import annotations

import asyncio
import json
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
import zmq.asyncio
from PIL import Image

from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.cache import EmbeddingCache
from epdserve.encoder.grpc_codec import tensor_from_proto
from epdserve.encoder.pusher import EmbeddingPusher
from epdserve.encoder.server import EncoderServicer
from epdserve.encoder.vision import VisionEncoder
from epdserve.proto import encoder_pb2

MAX_PIXELS = 4_000_000
LONG_WAIT_MS = 60_000.0  # tests fill the patch budget exactly, which ends the window: nothing waits for it


def _png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _image(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def _request(rid: str, datas: list[bytes]) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(request_id=rid, images=[encoder_pb2.Image(data=d) for d in datas])


class _Context:
    """Records the status an Encode call aborts with."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code, message):
        self.aborted = (code, message)
        raise grpc.aio.AbortError()


@pytest.fixture(scope="module")
def encoder(tiny_model_path) -> VisionEncoder:
    return VisionEncoder(tiny_model_path, "cpu", "float32")


@pytest.fixture
def tower_calls(encoder, monkeypatch) -> list[list[list[int]]]:
    """The ``image_grid_thw`` rows of every vision tower forward, one list per call."""
    calls: list[list[list[int]]] = []
    forward = encoder.model.forward

    def counting_forward(pixels, grid_thw, **kwargs):
        calls.append(grid_thw.tolist())
        return forward(pixels, grid_thw=grid_thw, **kwargs)

    monkeypatch.setattr(encoder.model, "forward", counting_forward)
    return calls


def _assert_same_rows(batched: torch.Tensor, alone: torch.Tensor) -> None:
    # Not bitwise on CPU: the GEMM kernels of a Linear pick their blocking by row count, so the merger's MLP
    # (measured) rounds the same row differently in a 26-row batch than in a 6-row one: up to ~6e-7 absolute,
    # about one fp32 ulp of the larger outputs. Parity to transformers is checked bitwise on the alone rows.
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-6)


def _patches(encoder: VisionEncoder, datas: list[bytes]) -> int:
    return sum(encoder.num_patches(_image(d)) for d in datas)


def _run_concurrently(encoder, requests: list[encoder_pb2.EncodeRequest], **batcher_kw):
    """Encode ``requests`` concurrently through one servicer; ``(responses or None, contexts)`` in order."""

    async def run():
        tower = ThreadPoolExecutor(1)
        ctx = zmq.asyncio.Context()
        servicer = EncoderServicer(EmbeddingCache(64 << 20), EmbeddingPusher(ctx),
                                   EncodeBatcher(tower, **batcher_kw), MAX_PIXELS)
        servicer.encoder = encoder
        contexts = [_Context() for _ in requests]
        try:
            results = await asyncio.wait_for(asyncio.gather(
                *(servicer.Encode(r, c) for r, c in zip(requests, contexts)), return_exceptions=True), 30)
        finally:
            await servicer.aclose()
            tower.shutdown()
            ctx.term()
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, grpc.aio.AbortError):
                raise r
        return [None if isinstance(r, BaseException) else r for r in results], contexts

    return asyncio.run(run())


def test_concurrent_requests_share_one_forward_and_get_their_own_rows(encoder, tower_calls, tiny_model_path):
    sizes = [(64, 64), (100, 60), (224, 224), (300, 120), (56, 200), (448, 448), (64, 64), (500, 333)]
    datas = [_png(i, w, h) for i, (w, h) in enumerate(sizes)]
    alone = [encoder.encode([_image(d)])[0] for d in datas]
    tower_calls.clear()
    responses, _ = _run_concurrently(encoder, [_request(f"r{i}", [d]) for i, d in enumerate(datas)],
                                     batch_wait_ms=LONG_WAIT_MS, max_batch_patches=_patches(encoder, datas))
    assert len(tower_calls) == 1 < len(datas) and len(tower_calls[0]) == len(datas)

    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for response, data, (emb, grid) in zip(responses, datas, alone):
        [item] = response.images
        assert list(item.grid_thw) == grid and not item.cache_hit
        _assert_same_rows(tensor_from_proto(item.embedding), emb)
        inputs = encoder.image_processor(images=[_image(data)], return_tensors="pt")
        with torch.inference_mode():
            [ref] = hf.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        assert torch.equal(emb, ref)


def test_duplicate_images_across_requests_are_encoded_once(encoder, tower_calls):
    a, b = _png(10, 120, 90), _png(11, 90, 120)
    requests = [_request("1", [a]), _request("2", [a]), _request("3", [b, a]), _request("4", [b]),
                _request("5", [a, b, a])]
    responses, _ = _run_concurrently(encoder, requests, batch_wait_ms=LONG_WAIT_MS,
                                     max_batch_patches=_patches(encoder, [a, b]))
    assert sum(len(call) for call in tower_calls) == 2
    by_hash: dict[str, bytes] = {}
    for response in responses:
        for item in response.images:
            assert by_hash.setdefault(item.image_hash, item.embedding.data) == item.embedding.data
    assert len(by_hash) == 2


@pytest.mark.parametrize("kind", ["corrupt", "aspect-ratio"])
def test_bad_image_fails_only_its_own_request(encoder, tower_calls, kind):
    good = [_png(20 + i, 80 + 8 * i, 64) for i in range(4)]
    # An aspect ratio over 200 decodes fine but the image processor rejects it: caught before batching.
    bad = {"corrupt": b"not an image" * 20, "aspect-ratio": _png(30, 300, 1)}[kind]
    requests = [_request("r0", [good[0]]), _request("r1", [good[1], bad]), _request("r2", [good[2]]),
                _request("r3", [good[3]])]
    responses, contexts = _run_concurrently(encoder, requests, batch_wait_ms=LONG_WAIT_MS,
                                            max_batch_patches=_patches(encoder, good))
    assert responses[1] is None and contexts[1].aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert contexts[1].aborted[1].startswith("image 1: ")
    assert len(tower_calls) == 1 and len(tower_calls[0]) == 4  # the good image of r1 still shared the batch
    for i in (0, 2, 3):
        assert contexts[i].aborted is None
        _assert_same_rows(tensor_from_proto(responses[i].images[0].embedding),
                          encoder.encode([_image(good[i])])[0][0])


def test_patch_budget_splits_batches(encoder, tower_calls):
    small = [_png(40 + i, 64, 64) for i in range(4)]  # 16 patches each
    assert {encoder.num_patches(_image(d)) for d in small} == {16}
    _run_concurrently(encoder, [_request(str(i), [d]) for i, d in enumerate(small)],
                      batch_wait_ms=LONG_WAIT_MS, max_batch_patches=32)
    assert [len(call) for call in tower_calls] == [2, 2]



def test_tower_failure_fails_its_batch_with_internal_and_server_recovers(encoder, monkeypatch):
    datas = [_png(60 + i, 64, 64) for i in range(3)]
    real_forward = encoder.model.forward

    def exploding(*args, **kwargs):
        raise RuntimeError("tower exploded")

    monkeypatch.setattr(encoder.model, "forward", exploding)

    async def run():
        tower = ThreadPoolExecutor(1)
        ctx = zmq.asyncio.Context()
        batcher = EncodeBatcher(tower, LONG_WAIT_MS, _patches(encoder, datas))
        servicer = EncoderServicer(EmbeddingCache(1 << 20), EmbeddingPusher(ctx), batcher, MAX_PIXELS)
        servicer.encoder = encoder
        contexts = [_Context() for _ in datas]
        results = await asyncio.gather(*(servicer.Encode(_request(str(i), [d]), c)
                                         for i, (d, c) in enumerate(zip(datas, contexts))), return_exceptions=True)
        calls = batcher.calls
        monkeypatch.setattr(encoder.model, "forward", real_forward)
        ok = await servicer.Encode(_request("after", datas), _Context())  # not stuck "in flight"
        await servicer.aclose()
        tower.shutdown()
        ctx.term()
        return results, contexts, calls, ok

    results, contexts, calls, ok = asyncio.run(run())
    assert calls == 1 and all(isinstance(r, grpc.aio.AbortError) for r in results)
    assert [c.aborted for c in contexts] == [(grpc.StatusCode.INTERNAL, "RuntimeError: tower exploded")] * 3
    assert [(r.cache_hit, r.num_tokens) for r in ok.images] == [(False, 4)] * 3


class _GatedEncoder:
    """Records each preprocessing and tower call; the first tower call blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.prepped: list[list[int]] = []  # image widths of each preprocessing call
        self.widths: list[list[int]] = []  # ... and of each tower call
        self.started = threading.Event()
        self.release = threading.Event()

    def preprocess(self, images):
        self.prepped.append([img.size[0] for img in images])
        return images

    def run_tower(self, images):
        self.calls.append(len(images))
        self.widths.append([img.size[0] for img in images])
        self.started.set()
        assert self.release.wait(30)
        return [(torch.full((1, 2), float(img.size[0])), [1, 2, 2]) for img in images]


def test_images_queue_while_the_tower_runs_and_go_in_the_next_batch():
    async def run():
        tower = ThreadPoolExecutor(1)
        batcher = EncodeBatcher(tower, batch_wait_ms=0, max_batch_patches=1000)
        enc = _GatedEncoder()
        first = batcher.submit(enc, Image.new("RGB", (1, 1)), 4)  # the tower is idle: runs at once, alone
        await asyncio.to_thread(enc.started.wait, 30)
        later = [batcher.submit(enc, Image.new("RGB", (w, 1)), 4) for w in (2, 3, 4)]
        enc.release.set()
        outs = await asyncio.gather(first, *later)
        await batcher.aclose()
        tower.shutdown()
        return enc.calls, outs

    calls, outs = asyncio.run(run())
    assert calls == [1, 3]
    assert [out[0][0, 0].item() for out in outs] == [1.0, 2.0, 3.0, 4.0]  # each future got its own image's rows


def test_first_fit_under_the_budget_and_a_large_image_alone():
    async def run():
        tower = ThreadPoolExecutor(1)
        batcher = EncodeBatcher(tower, batch_wait_ms=0, max_batch_patches=32)
        enc = _GatedEncoder()
        first = batcher.submit(enc, Image.new("RGB", (1, 1)), 4)
        await asyncio.to_thread(enc.started.wait, 30)
        # Queued behind the running call: 16 + 256 + 16 patches under a budget of 32.
        later = [batcher.submit(enc, Image.new("RGB", (w, 1)), p) for w, p in ((2, 16), (3, 256), (4, 16))]
        enc.release.set()
        outs = await asyncio.gather(first, *later)
        await batcher.aclose()
        tower.shutdown()
        return enc, outs

    enc, outs = asyncio.run(run())
    # The small images after the large one still join the first batch; the large one follows, alone.
    assert enc.calls == [1, 2, 1] and enc.widths == [[1], [2, 4], [3]]
    assert [out[0][0, 0].item() for out in outs] == [1.0, 2.0, 3.0, 4.0]


def test_batcher_rejects_bad_settings():
    with ThreadPoolExecutor(1) as tower:
        with pytest.raises(ValueError, match="batch_wait_ms"):
            EncodeBatcher(tower, batch_wait_ms=-1)
        with pytest.raises(ValueError, match="max_batch_patches"):
            EncodeBatcher(tower, max_batch_patches=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_preprocessing_batches_like_alone(tiny_model_path):
    # The processor runs on the GPU (its device argument): grids are the CPU ones, a batch matches each image
    # alone up to kernel noise, and GPU resizing stays close to the CPU reference.
    gpu = VisionEncoder(tiny_model_path, "cuda", "float32")
    cpu = VisionEncoder(tiny_model_path, "cpu", "float32")
    images = [_image(_png(70 + i, w, h)) for i, (w, h) in enumerate([(64, 64), (300, 120), (448, 448)])]
    batched = gpu.encode(images)
    for img, (emb, grid) in zip(images, batched):
        [(alone, grid_alone)] = gpu.encode([img])
        [(ref, grid_cpu)] = cpu.encode([img])
        assert grid == grid_alone == grid_cpu and emb.is_cuda  # left on the GPU for the CUDA IPC hand-off
        torch.testing.assert_close(emb, alone, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(emb.cpu(), ref, atol=5e-2, rtol=5e-2)
    print(f"CUDA preprocessing, float32: {len(images)} images batched equal each alone (atol 1e-4), within 5e-2 of "
          "the CPU's, same grids")


def test_encoder_benchmark_smoke(tiny_model_path, tmp_path, capsys):
    from epdserve.bench.encoder import main

    out = tmp_path / "enc.json"
    assert main(["--model-path", tiny_model_path, "--image-sizes", "56x56", "64x48", "--batch", "1", "4",
                 "--num-images", "6", "--warmup", "1", "--device", "cpu", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["image_size"], r["batch"]) for r in rows] == [("56x56", 1), ("56x56", 4), ("64x48", 1), ("64x48", 4)]
    for r in rows:
        assert r["num_images"] == 6 and r["images_per_s"] > 0 and r["tokens_per_image"] == 4
        assert 1 <= r["tower_calls"] <= 6
        if r["batch"] == 1:  # one request at a time: every image is its own tower call
            assert r["tower_calls"] == 6
    table = capsys.readouterr().out
    assert "images/s" in table and "64x48" in table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_tower_uses_packed_attention_and_matches_cpu(tiny_model_path):
    # On CUDA in bf16 the tower runs PyTorch's FlashAttention-2 varlen kernel once per layer instead of SDPA once
    # per window; embeddings stay close to the float32 CPU reference.
    from epdserve.encoder.varlen_attention import NAME

    gpu = VisionEncoder(tiny_model_path, "cuda", "bfloat16")
    cpu = VisionEncoder(tiny_model_path, "cpu", "float32")
    assert gpu.model.config._attn_implementation == NAME
    images = [_image(_png(90 + i, w, h)) for i, (w, h) in enumerate([(300, 120), (448, 448)])]
    worst = 1.0
    for (emb, grid), (ref, grid_cpu) in zip(gpu.encode(images), cpu.encode(images)):
        assert grid == grid_cpu
        cos = torch.nn.functional.cosine_similarity(emb.float().cpu().flatten(), ref.flatten(), dim=0)
        assert cos > 0.99, f"bf16 packed-attention embeddings drifted from the CPU reference (cosine {cos:.4f})"
        worst = min(worst, float(cos))
    print(f"bf16 tower on packed varlen attention: lowest cosine to the float32 CPU tower {worst:.5f} (bound 0.99)")


def test_next_batch_is_preprocessed_while_the_tower_runs_and_at_most_one_waits():
    async def run():
        tower = ThreadPoolExecutor(1)
        batcher = EncodeBatcher(tower, batch_wait_ms=0, max_batch_patches=1000)
        enc = _GatedEncoder()
        futs = [batcher.submit(enc, Image.new("RGB", (1, 1)), 4)]
        await asyncio.to_thread(enc.started.wait, 30)  # batch [1] is on the tower, held there
        futs += [batcher.submit(enc, Image.new("RGB", (w, 1)), 4) for w in (2, 3)]
        for _ in range(500):  # [2, 3] gets preprocessed while the tower is still busy with [1]
            if len(enc.prepped) == 2:
                break
            await asyncio.sleep(0.01)
        futs.append(batcher.submit(enc, Image.new("RGB", (4, 1)), 4))
        await asyncio.sleep(0.2)
        during = [list(b) for b in enc.prepped]  # [4] waits: one batch ready for the tower is enough
        enc.release.set()
        outs = await asyncio.gather(*futs)
        await batcher.aclose()
        tower.shutdown()
        return during, enc, outs

    during, enc, outs = asyncio.run(run())
    assert during == [[1], [2, 3]]
    assert enc.prepped == enc.widths == [[1], [2, 3], [4]]
    assert [out[0][0, 0].item() for out in outs] == [1.0, 2.0, 3.0, 4.0]


class _SlowTower:
    """Instant preprocessing, a tower call of ``tower_s`` seconds; records each tower call's image widths."""

    def __init__(self, tower_s: float) -> None:
        self.tower_s, self.widths = tower_s, []

    def preprocess(self, images):
        return images

    def run_tower(self, images):
        self.widths.append([img.size[0] for img in images])
        time.sleep(self.tower_s)
        return [(torch.full((1, 2), float(img.size[0])), [1, 2, 2]) for img in images]


def test_with_the_tower_busy_the_next_batch_is_taken_just_in_time():
    # Images arriving one by one while the tower runs all join the next batch: it is taken when its (instant)
    # preprocessing would end with the tower's call, not as soon as the preprocessing thread is free.
    async def run():
        tower = ThreadPoolExecutor(1)
        batcher = EncodeBatcher(tower, batch_wait_ms=0, max_batch_patches=1000)
        enc = _SlowTower(0.4)
        await batcher.submit(enc, Image.new("RGB", (9, 1)), 4)  # one call to learn the stages' durations
        futs = [batcher.submit(enc, Image.new("RGB", (1, 1)), 4)]
        for w in (2, 3, 4):
            await asyncio.sleep(0.05)
            futs.append(batcher.submit(enc, Image.new("RGB", (w, 1)), 4))
        outs = await asyncio.gather(*futs)
        await batcher.aclose()
        tower.shutdown()
        return enc.widths, outs

    widths, outs = asyncio.run(run())
    assert widths == [[9], [1], [2, 3, 4]]
    assert [out[0][0, 0].item() for out in outs] == [1.0, 2.0, 3.0, 4.0]


def test_the_window_waits_only_for_announced_images():
    # A lone image runs at once although the window is a minute; an announced image is waited for (the batch
    # starts as soon as it arrives, not after the window); a withdrawn one is not.
    async def run():
        tower = ThreadPoolExecutor(1)
        batcher = EncodeBatcher(tower, batch_wait_ms=LONG_WAIT_MS, max_batch_patches=1000)
        enc = _GatedEncoder()
        enc.release.set()
        t0 = time.monotonic()
        await batcher.submit(enc, Image.new("RGB", (1, 1)), 4)
        alone_s = time.monotonic() - t0

        batcher.announce()
        first = batcher.submit(enc, Image.new("RGB", (2, 1)), 4)
        await asyncio.sleep(0.2)  # the announced image is still "decoding": the batch must not start
        waited = list(enc.calls)
        second = batcher.submit(enc, Image.new("RGB", (3, 1)), 4, announced=True)
        await asyncio.wait_for(asyncio.gather(first, second), 10)

        batcher.announce()
        third = batcher.submit(enc, Image.new("RGB", (4, 1)), 4)
        await asyncio.sleep(0.05)
        batcher.withdraw()  # its decode failed: nothing more is coming
        await asyncio.wait_for(third, 10)
        await batcher.aclose()
        tower.shutdown()
        return alone_s, waited, enc.widths

    alone_s, waited, widths = asyncio.run(run())
    assert alone_s < 5
    assert waited == [1]  # only the lone image's call while the second was announced
    assert widths == [[1], [2, 3], [4]]


def _jpeg(seed: int, width: int, height: int, noise: bool) -> bytes:
    """A JPEG (quality 90, 4:2:0 chroma) of smooth color fields with edges, or of noise."""
    rng = np.random.default_rng(seed)
    if noise:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width] / max(width, height)
        pixels = np.stack([np.sin(7 * x + c) * 90 + 128 + 60 * ((x - 0.4) ** 2 + (y - 0.3) ** 2 < 0.05)
                           for c in rng.uniform(0, 6, 3)], -1).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_jpeg_decode_is_close_to_pil_and_falls_back_for_the_rest(tiny_model_path):
    # nvJPEG's pixels are not libjpeg-turbo's. On smooth content they differ by under a level on average and the
    # embeddings agree far closer than bf16 agrees with float32 (the test above: cosine > 0.99). Its chroma
    # upsampling is not libjpeg's "fancy" (interpolating) one, so on noise, whose colour changes every pixel, RGB
    # differs by ~13 levels (H100), while luma, stored at full resolution, still agrees: the decode is right.
    from epdserve.encoder.vision import ImageDecodeError, decode_image

    enc = VisionEncoder(tiny_model_path, "cuda", "bfloat16", gpu_jpeg_decode=True)
    assert not VisionEncoder(tiny_model_path, "cpu", "float32", gpu_jpeg_decode=True).gpu_jpeg_decode
    luma = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)  # BT.601, as JPEG's YCbCr
    for i, (w, h, noise) in enumerate([(448, 448, False), (1280, 720, False), (448, 448, True), (301, 97, False)]):
        data = _jpeg(i, w, h, noise)
        gpu = enc.decode(data, 1 << 30)
        assert isinstance(gpu, torch.Tensor) and gpu.is_cuda and gpu.dtype == torch.uint8
        pil = decode_image(data, 1 << 30)
        assert tuple(gpu.shape) == (3, h, w) and enc.num_patches(gpu) == enc.num_patches(pil)
        got, want = gpu.cpu().float(), torch.from_numpy(np.asarray(pil)).permute(2, 0, 1).float()
        luma_diff = ((got - want) * luma).sum(0).abs().mean()
        assert luma_diff < 1.0, f"{w}x{h} noise={noise}: nvJPEG's luma differs from PIL's by {luma_diff:.2f} levels"
        if noise:
            continue
        diff = (got - want).abs().mean()
        assert diff < 1.5, f"{w}x{h}: nvJPEG differs from PIL by {diff:.2f} levels"
        [(emb, grid)], [(ref, grid_pil)] = enc.encode([gpu]), enc.encode([pil])
        cos = torch.nn.functional.cosine_similarity(emb.float().flatten(), ref.float().flatten(), dim=0)
        assert grid == grid_pil and cos > 0.999, f"{w}x{h}: cosine {cos:.5f}"
    # What nvJPEG does not take goes to PIL: a PNG decodes there; a truncated JPEG gets PIL's error (nvJPEG
    # would pad it); an image over the pixel limit is refused before any decoding.
    assert isinstance(enc.decode(_png(5, 64, 48), 1 << 30), Image.Image)
    data = _jpeg(9, 448, 448, False)
    with pytest.raises(ImageDecodeError):
        enc.decode(data[: len(data) // 2], 1 << 30)
    with pytest.raises(ImageDecodeError, match="larger than the limit"):
        enc.decode(data, 448 * 447)
    print("nvJPEG: 4 JPEGs decode within 1 luma level of PIL (smooth ones within 1.5 RGB levels, embeddings at "
          "cosine > 0.999); PNG, truncated and oversized images take PIL's path or are refused")
