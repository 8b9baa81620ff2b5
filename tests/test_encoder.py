"""The encoder stage: vision tower parity with transformers, the gRPC server, the cache, ZMQ push to TP ranks."""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from epdserve.config import EncoderConfig
from epdserve.encoder import server as server_mod
from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.cache import EmbeddingCache
from epdserve.encoder.grpc_codec import tensor_from_proto, tensor_to_proto
from epdserve.encoder.pusher import EmbeddingPusher
from epdserve.encoder.server import EncoderServicer, serve
from epdserve.encoder.vision import VisionEncoder, decode_image
from epdserve.kvcache.kv_share import host_id
from epdserve.wire.messages import ImageEmbeddings, decode
from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from epdserve.wire.ports import free_port

REPO = Path(__file__).resolve().parents[1]
MAX_PIXELS = 4_000_000
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


class ServerThread:
    """``serve(config)`` on its own event loop in a daemon thread, so tests can use the plain sync gRPC client."""

    def __init__(self, model_path: str, **overrides) -> None:
        self.config = EncoderConfig(model_path=model_path, port=free_port(), cache_size_mb=64,
                                    max_image_pixels=MAX_PIXELS, **{"metrics_port": 0, **overrides})
        self.address = f"127.0.0.1:{self.config.port}"
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._ready = threading.Event()

    def start(self, wait_ready: bool = True) -> ServerThread:
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._started.wait(30)
        if wait_ready:
            assert self._ready.wait(60), "encoder not ready in 60 s"
            if self.error is not None:
                raise self.error
        return self

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        self._task = asyncio.create_task(serve(self.config, ready))
        ready_wait = asyncio.create_task(ready.wait())
        self._started.set()
        await asyncio.wait({self._task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        self._ready.set()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # surfaced to the test by start()
            self.error = e
            self._ready.set()
        finally:
            ready_wait.cancel()

    def stop(self) -> None:
        """Cancel serve() and wait for its shutdown: a gRPC server left half-stopped can hang interpreter exit."""
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)
        assert not self._thread.is_alive(), "encoder server did not shut down"
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def encoder_addr(tiny_model_path):
    srv = ServerThread(tiny_model_path).start()
    yield srv.address
    srv.stop()


@pytest.fixture(scope="module")
def channel(encoder_addr):
    with grpc.insecure_channel(encoder_addr, options=_CHANNEL_OPTIONS) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return encoder_pb2_grpc.EncoderStub(channel)


@pytest.fixture(scope="module")
def photos(photo_paths) -> dict[str, bytes]:
    return {name: p.read_bytes() for name, p in photo_paths.items()}


def _hf_reference(model_path: str, datas: list[bytes]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """grid_thw rows and per-image embeddings from transformers' full model, for the same processor output."""
    from transformers import (AutoConfig, AutoProcessor, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLForConditionalGeneration)

    cls = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration}[
        AutoConfig.from_pretrained(model_path).model_type]
    model = cls.from_pretrained(model_path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_path).image_processor
    images = [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]
    inputs = processor(images=images, return_tensors="pt")
    with torch.inference_mode():
        feats = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return inputs["image_grid_thw"].tolist(), list(feats)


def _request(rid: str, datas: list[bytes], targets: list[str] = ()) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(request_id=rid, images=[encoder_pb2.Image(data=d) for d in datas],
                                     targets=list(targets))


def _check_against_hf(response, model_path: str, datas: list[bytes]) -> None:
    grids, refs = _hf_reference(model_path, datas)
    assert len(response.images) == len(datas)
    for result, data, grid, ref in zip(response.images, datas, grids, refs):
        assert result.image_hash == hashlib.sha256(data).hexdigest()
        assert list(result.grid_thw) == grid
        assert result.num_tokens == grid[0] * grid[1] * grid[2] // 4 == ref.shape[0]
        emb = tensor_from_proto(result.embedding)
        assert emb.dtype == torch.float32 and emb.shape == ref.shape
        torch.testing.assert_close(emb, ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- gRPC server


def test_encode_one_and_two_photos_match_transformers(stub, photos, tiny_model_path):
    one = [photos["chelsea"]]
    response = stub.Encode(_request("one", one), timeout=60)
    assert response.request_id == "one" and not response.images[0].cache_hit
    _check_against_hf(response, tiny_model_path, one)

    two = [photos["rocket"], photos["page"]]  # a JPEG and a grayscale PNG, different grids
    response = stub.Encode(_request("two", two), timeout=60)
    assert [r.cache_hit for r in response.images] == [False, False]
    _check_against_hf(response, tiny_model_path, two)


def test_repeated_image_comes_from_cache(stub, photos):
    first = stub.Encode(_request("c1", [photos["camera"], photos["camera"]]), timeout=60)
    # Both copies come from this request's single encode, not from the cache.
    assert [r.cache_hit for r in first.images] == [False, False]
    second = stub.Encode(_request("c2", [photos["camera"]]), timeout=60)
    assert second.images[0].cache_hit
    for r in (first.images[1], second.images[0]):
        assert r.image_hash == first.images[0].image_hash and list(r.grid_thw) == list(first.images[0].grid_thw)
        assert r.embedding.data == first.images[0].embedding.data


def test_targets_push_to_every_tp_rank(stub, photos):
    ctx = zmq.Context()
    pulls = [ctx.socket(zmq.PULL) for _ in range(2)]
    try:
        for s in pulls:
            s.bind("tcp://127.0.0.1:*")
        endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in pulls]
        datas = [photos["astronaut"], photos["coffee"]]
        request = _request("push-1", datas, endpoints)
        request.share_host_id = host_id()  # this machine, but a CPU tower: the embeddings still go as bytes
        response = stub.Encode(request, timeout=60)
        assert [r.HasField("embedding") for r in response.images] == [False, False]
        msgs = []
        for s in pulls:
            assert s.poll(10_000), "a TP rank got no embeddings"
            msgs.append(decode(s.recv_multipart()))
            assert not s.poll(200), "a TP rank got the embeddings twice"
    finally:
        for s in pulls:
            s.close(linger=0)
        ctx.term()
    standalone = stub.Encode(_request("push-2", datas), timeout=60)
    for msg in msgs:
        assert isinstance(msg, ImageEmbeddings) and msg.rid == "push-1"
        assert msg.image_hashes == [r.image_hash for r in response.images]
        for emb, r, s in zip(msg.embeddings, response.images, standalone.images):
            assert emb.shape == (r.num_tokens, 128) and emb.dtype == torch.float32
            assert torch.equal(emb, tensor_from_proto(s.embedding))
    assert all(torch.equal(a, b) for a, b in zip(msgs[0].embeddings, msgs[1].embeddings))


def _bomb_png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (3000, 2000)).save(buf, format="PNG")  # 6 Mpx > MAX_PIXELS, but only a few KB
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "empty", "bomb"])
def test_bad_image_is_invalid_argument_and_server_keeps_serving(stub, photos, kind):
    bad = {"corrupt": b"definitely not an image" * 10, "truncated": photos["chelsea"][: len(photos["chelsea"]) // 2],
           "empty": b"", "bomb": _bomb_png()}[kind]
    with pytest.raises(grpc.RpcError) as err:
        stub.Encode(_request(f"bad-{kind}", [photos["chelsea"], bad]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 1" in err.value.details()
    if kind == "bomb":
        assert "3000x2000" in err.value.details()
    ok = stub.Encode(_request(f"good-after-{kind}", [photos["chelsea"]]), timeout=60)
    assert ok.images[0].num_tokens > 0


def test_no_images_and_bad_targets_are_invalid_argument(stub, photos):
    for request, needle in [(_request("empty", []), "no images"),
                            (_request("", [photos["chelsea"]], ["tcp://127.0.0.1:1"]), "request_id"),
                            (_request("t", [photos["chelsea"]], ["not-an-endpoint"]), "not-an-endpoint")]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Encode(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()


def test_health_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "epdserve.v1.Encoder"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(channel):
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"epdserve.v1.Encoder", "grpc.health.v1.Health"} <= names


def test_100mb_request(stub, photos, tiny_model_path):
    # A real PNG followed by 100 MiB of trailing bytes: PIL stops at IEND, so the image is the same, but the
    # request (and the hashed bytes) really are 100 MiB.
    data = photos["coffee"] + bytes(100 << 20)
    response = stub.Encode(_request("big", [data]), timeout=120)
    assert response.images[0].image_hash == hashlib.sha256(data).hexdigest()
    _, refs = _hf_reference(tiny_model_path, [photos["coffee"]])
    torch.testing.assert_close(tensor_from_proto(response.images[0].embedding), refs[0], atol=1e-5, rtol=0)


def test_example_client(encoder_addr, photo_paths):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "encode_grpc.py"), "--addr", encoder_addr,
                          str(photo_paths["rocket"])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "grid_thw    [1, 30, 46]" in out.stdout and "embedding   [345, 128] float32" in out.stdout


def test_main_logs_one_ready_line_and_stops_on_sigterm(tiny_model_path, photos):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "epdserve.encoder.server", "--model-path", tiny_model_path,
                             "--port", str(port), "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(60, proc.kill)  # readline() below would block forever on a silent hang
    watchdog.start()
    try:
        first = proc.stdout.readline()
        assert f"encoder ready on 127.0.0.1:{port}" in first and tiny_model_path in first, first
        parts = r"process [\d.]+ s, processor [\d.]+ s, tower [\d.]+ s, weights [\d.]+ s, warm-up [\d.]+ s"
        assert re.search(rf"; started in [\d.]+ s \({parts}\)$", first.strip()), first
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS) as ch:
            ok = encoder_pb2_grpc.EncoderStub(ch).Encode(_request("sub", [photos["chelsea"]]), timeout=30)
        assert ok.images[0].num_tokens == 176
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert proc.stdout.read() == ""  # quiet: nothing but the ready line
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()


def test_qwen2_vl_checkpoint(tiny_qwen2_vl_path, photos):
    srv = ServerThread(tiny_qwen2_vl_path).start()
    try:
        with grpc.insecure_channel(srv.address, options=_CHANNEL_OPTIONS) as ch:
            datas = [photos["chelsea"], photos["astronaut"]]
            response = encoder_pb2_grpc.EncoderStub(ch).Encode(_request("q2", datas), timeout=60)
    finally:
        srv.stop()
    _check_against_hf(response, tiny_qwen2_vl_path, datas)


def test_not_serving_until_model_loaded(tiny_model_path, photos, monkeypatch):
    release = threading.Event()

    def slow_encoder(*args):
        assert release.wait(30)
        return VisionEncoder(*args)

    monkeypatch.setattr(server_mod, "VisionEncoder", slow_encoder)
    srv = ServerThread(tiny_model_path).start(wait_ready=False)
    try:
        with grpc.insecure_channel(srv.address, options=_CHANNEL_OPTIONS) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            health = health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest(service="epdserve.v1.Encoder")
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                encoder_pb2_grpc.EncoderStub(ch).Encode(_request("early", [photos["chelsea"]]), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            release.set()
            assert srv._ready.wait(30) and srv.error is None
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        srv.stop()


# ------------------------------------------------------------------------------------------ units


def test_vision_encoder_bfloat16(tiny_model_path, photos):
    enc = VisionEncoder(tiny_model_path, "cpu", "bfloat16")
    [(emb, grid)] = enc.encode([Image.open(io.BytesIO(photos["chelsea"])).convert("RGB")])
    assert emb.dtype == torch.bfloat16 and emb.shape == (enc.num_tokens(grid), enc.hidden_size)
    assert torch.equal(tensor_from_proto(tensor_to_proto(emb)), emb)


def test_cache_lru_by_bytes():
    cache = EmbeddingCache(capacity_bytes=3 * 400)
    for k in "abc":
        assert cache.put(k, torch.zeros(10, 10), [1, 2, 2])  # 400 bytes each
    assert cache.get("a") is not None  # refresh a: b is now the least recently used
    assert cache.put("d", torch.zeros(10, 10), [1, 2, 2])
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert not cache.put("huge", torch.zeros(100, 100), [1, 20, 20]) and "huge" not in cache
    assert cache.get("b") is None
    assert cache.stats() == {"entries": 3, "size_bytes": 1200, "capacity_bytes": 1200, "hits": 1, "misses": 1}


class _CountingEncoder:
    """Stands in for VisionEncoder: records each tower call, takes a while so requests overlap."""

    merge_size = 2

    def __init__(self) -> None:
        self.calls: list[int] = []

    def num_tokens(self, grid):
        return grid[0] * grid[1] * grid[2] // 4

    def num_patches(self, image):
        return 16

    def decode(self, data, max_pixels):
        return decode_image(data, max_pixels)

    def preprocess(self, images):
        return images

    def run_tower(self, images):
        self.calls.append(len(images))
        time.sleep(0.2)
        return [(torch.full((4, 8), float(img.size[0])), [1, 4, 4]) for img in images]


def test_concurrent_requests_share_one_encode(photos):
    class Context:
        async def abort(self, code, message):
            raise AssertionError(f"{code}: {message}")

    async def run():
        from concurrent.futures import ThreadPoolExecutor

        tower = ThreadPoolExecutor(1)
        ctx = zmq.asyncio.Context()
        servicer = EncoderServicer(EmbeddingCache(1 << 20), EmbeddingPusher(ctx), EncodeBatcher(tower), MAX_PIXELS)
        servicer.encoder = _CountingEncoder()
        a = _request("a", [photos["chelsea"], photos["rocket"], photos["chelsea"]])
        b = _request("b", [photos["rocket"]])
        ra, rb = await asyncio.gather(servicer.Encode(a, Context()), servicer.Encode(b, Context()))
        rc = await servicer.Encode(b, Context())
        tower.shutdown()
        ctx.term()
        return servicer.encoder.calls, ra, rb, rc

    calls, ra, rb, rc = asyncio.run(run())
    # chelsea and rocket are encoded once each: in one batch when request a claims both first, else rocket in
    # b's batch and a waits for it (which request hashes first is up to the threads).
    assert sorted(calls) in ([2], [1, 1])
    assert [r.cache_hit for r in ra.images] == [False, False, False] and not rb.images[0].cache_hit
    assert rc.images[0].cache_hit and rb.images[0].embedding.data == ra.images[1].embedding.data


class _FailingEncoder(_CountingEncoder):
    def run_tower(self, images):
        raise RuntimeError("tower exploded")


def test_unexpected_error_is_internal_and_server_recovers(photos):
    class Context:
        def __init__(self):
            self.aborted = None

        async def abort(self, code, message):
            self.aborted = (code, message)
            raise grpc.aio.AbortError()

    async def run():
        from concurrent.futures import ThreadPoolExecutor

        tower = ThreadPoolExecutor(1)
        ctx = zmq.asyncio.Context()
        servicer = EncoderServicer(EmbeddingCache(1 << 20), EmbeddingPusher(ctx), EncodeBatcher(tower), MAX_PIXELS)
        servicer.encoder = _FailingEncoder()
        failed = Context()
        with pytest.raises(grpc.aio.AbortError):
            await servicer.Encode(_request("boom", [photos["chelsea"]]), failed)
        servicer.encoder = _CountingEncoder()  # the failed image is not stuck "in flight"
        ok = await servicer.Encode(_request("after", [photos["chelsea"]]), Context())
        tower.shutdown()
        ctx.term()
        return failed.aborted, ok

    aborted, ok = asyncio.run(run())
    assert aborted == (grpc.StatusCode.INTERNAL, "RuntimeError: tower exploded")
    assert ok.images[0].num_tokens == 4 and not ok.images[0].cache_hit


def test_sharded_checkpoint_with_model_visual_prefix(tiny_model_path, tmp_path, photos):
    # Rewrite the tiny checkpoint the way transformers-5-native and large checkpoints look: tensors named
    # model.visual.* and split over shards listed in model.safetensors.index.json.
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    for f in Path(tiny_model_path).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    renamed = {("model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, names in shards.items():
        save_file({k: renamed[k] for k in names}, str(tmp_path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    image = [Image.open(io.BytesIO(photos["coffee"])).convert("RGB")]
    [(sharded, grid)] = VisionEncoder(tmp_path, "cpu", "float32").encode(image)
    [(single, grid1)] = VisionEncoder(tiny_model_path, "cpu", "float32").encode(image)
    assert grid == grid1 and torch.equal(sharded, single)
