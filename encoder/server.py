"""The encoder server: gRPC ``epdserve.v1.Encoder/Encode`` in front of the vision tower and the embedding cache.

A request's images are hashed and looked up in the cache; each missing one is decoded on a worker thread and
queued to the batcher, which encodes the pending images of all concurrent requests together in one tower call on
a single tower thread (the event loop keeps answering health checks meanwhile). An image already being encoded
for another request is awaited, not encoded again. A request's videos go the same way under their key
(:func:`epdserve.hashing.video_key`): decoded to the frames the checkpoint samples on a worker thread, then one
tower call each through the batcher (:mod:`epdserve.encoder.video`). With ``targets`` the embeddings are pushed
over ZMQ to every TP rank of one prefill server before the response is sent; without, they come back in the
response.

Run it with ``python -m epdserve.encoder.server --port 50051`` (flags: :class:`epdserve.config.EncoderConfig`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
import zmq
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from PIL import Image

from epdserve.hashing import sha256_all, video_key
from epdserve.config import EncoderConfig
from epdserve.device import limit_cpu_threads, resolve_device, resolve_dtype
from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.cache import EmbeddingCache
from epdserve.encoder.grpc_codec import SERVICE_NAME, MalformedRequest, RequestError, add_servicer, tensor_to_proto
from epdserve.encoder.info import model_info, server_info
from epdserve.encoder.outbox import EmbeddingOutbox
from epdserve.encoder.pusher import EmbeddingPusher
from epdserve.encoder.tower_compile import compile_beside_serving
from epdserve.encoder.video import VideoJob, decode_video
from epdserve.encoder.vision import ImageDecodeError, VisionEncoder
from epdserve.logging_setup import request_context, startup_summary
from epdserve.encoder.metrics import EncoderMetrics
from epdserve.metrics import start_metrics_server
from epdserve.models.paths import resolve_model_path
from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from epdserve.video import VideoError, VideoLimits

log = logging.getLogger("epdserve.encoder")  # not __name__: that is "__main__" under python -m

MIB = 1 << 20
# Seconds the encoder waits, model loaded, before it serves: a test hook that makes its start as slow as a real
# model's (tests of the launcher's ready line and of the gateway's /health).
LOAD_DELAY_ENV = "EPDSERVE_TEST_ENCODER_LOAD_DELAY_S"
def _decode_one(encoder: VisionEncoder, data: bytes, max_pixels: int) -> tuple[Image.Image | torch.Tensor, int]:
    image = encoder.decode(data, max_pixels)
    return image, encoder.num_patches(image)


def _keys(datas: list[bytes], videos: list[encoder_pb2.Video]) -> list[str]:
    """The images' hashes then the videos' keys, in request order (CPU-bound: SHA-256 of every byte).

    Raises:
        RequestError: INVALID_ARGUMENT for a video with both fps and num_frames, or a negative one.
    """
    keys = [d.hex() for d in sha256_all(datas)]
    for j, v in enumerate(videos):
        try:  # proto3's 0 is "unset": the checkpoint's default sampling
            keys.append(video_key(v.data, v.fps or None, v.num_frames or None))
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"video {j}: {e}") from None
    return keys


def _consume_exception(fut: asyncio.Future) -> None:
    # A failed encode may have no waiter left (its requests were cancelled); reading the exception here keeps
    # asyncio from logging "Future exception was never retrieved".
    if not fut.cancelled():
        fut.exception()


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """``epdserve.v1.Encoder``: Encode answers UNAVAILABLE until ``encoder`` is set (the model is loaded).

    Cache, in-flight map and tasks are touched only from the event loop. Each image missing from the cache is
    decoded on its own worker thread, then handed to ``batcher``, which encodes it together with the other
    requests' pending images (see :mod:`epdserve.encoder.batcher`).
    """

    def __init__(self, cache: EmbeddingCache, pusher: EmbeddingPusher, batcher: EncodeBatcher,
                 max_image_pixels: int, metrics: EncoderMetrics | None = None,
                 config: EncoderConfig | None = None, video_limits: VideoLimits = VideoLimits()) -> None:
        self.encoder: VisionEncoder | None = None
        self.metrics = metrics if metrics is not None else EncoderMetrics()
        self.metrics.watch(cache, batcher)
        self.config = config  # reported by GetServerInfo
        self.metrics_port = 0  # set by serve() once the /metrics server listens
        self.cache = cache
        self._pusher = pusher
        self._batcher = batcher
        self._max_pixels = max_image_pixels  # per image, and per video frame
        self._video_limits = video_limits
        # image hash or video key -> future of (embedding, grid_thw) for those being encoded now, shared by all
        # requests; the videos' keys are also in _inflight_videos.
        self._inflight: dict[str, asyncio.Future] = {}
        self._inflight_videos: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self.num_requests = 0  # Encode calls in progress
        self._outbox = EmbeddingOutbox(pusher, cache, self.metrics, self._tasks)

    @property
    def outbox(self) -> EmbeddingOutbox:
        """Where encoded embeddings go (pushes to prefill ranks, the cache's host copies)."""
        return self._outbox

    @property
    def batcher(self) -> EncodeBatcher:
        """The batcher this servicer queues images to."""
        return self._batcher

    async def Encode(self, request: encoder_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> encoder_pb2.EncodeResponse:
        """Encode the request's images and videos; see the module docstring and proto/encoder.proto for the
        semantics.

        Status codes: INVALID_ARGUMENT (no images or videos; an undecodable or too large image, or a video that does
        not decode, is over ``--max-video-frames`` / ``--max-video-duration-s`` / ``--max-image-pixels`` per frame
        or asks for both fps and num_frames, named by its index: "image 1: ...", "video 0: ..."; a bad target,
        targets without a request id), UNAVAILABLE (model loading, a target not accepting), INTERNAL (anything
        unexpected; the server keeps serving).
        """
        rid = request.request_id
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        with request_context(rid or None), self.metrics.track_request():
            self.num_requests += 1
            try:
                return await self._encode(request)
            except RequestError as e:
                code, message = e.code, str(e)
                log.log(e.log_level, "rid=%s %s: %s", rid, code.name, message)
            except Exception as e:
                log.exception("rid=%s encode failed", rid)
                code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
            finally:
                self.num_requests -= 1
            self.metrics.on_error(code.name)
            await context.abort(code, message)

    async def GetModelInfo(self, request: encoder_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> encoder_pb2.GetModelInfoResponse:
        """The served vision model (path, type, device, dtype, patch geometry); UNAVAILABLE while it loads."""
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        if self.encoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the vision model is still loading")
        return model_info(self.encoder)

    async def GetServerInfo(self, request: encoder_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> encoder_pb2.GetServerInfoResponse:
        """Flags, readiness, metrics port, embedding cache and batcher state (answers while loading too)."""
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return server_info(self.config, self.encoder is not None, self.metrics_port, self.cache, self.batcher,
                           self.metrics)

    async def GetLoad(self, request: encoder_pb2.EncoderLoadRequest,
                      context: grpc.aio.ServicerContext) -> encoder_pb2.EncoderLoad:
        """Requests and images in flight and the cache's size now (see proto/encoder.proto)."""
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        videos = len(self._inflight_videos)
        return encoder_pb2.EncoderLoad(num_requests=self.num_requests, num_videos_encoding=videos,
                                       num_images_encoding=len(self._inflight) - videos,
                                       cached_embeddings=len(self.cache), cache_bytes=self.cache.size_bytes,
                                       push_sockets=self._pusher.num_sockets)

    async def _encode(self, request: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeResponse:
        rid = request.request_id
        encoder = self.encoder
        if encoder is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the vision model is still loading")
        if not request.images and not request.videos:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request has no images or videos")
        targets = list(dict.fromkeys(request.targets))  # a rank listed twice must not get the message twice
        if targets and not rid:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required when targets are given")
        self._pusher.connect(targets)  # a malformed target fails the request before any encoding
        # The images' bytes, then the videos: one list, so that both share the cache, in-flight map and push.
        sources: list[bytes | encoder_pb2.Video] = [im.data for im in request.images]
        num_images = len(sources)
        sources += request.videos
        self.metrics.images.inc(num_images)
        self.metrics.videos.inc(len(request.videos))
        # From here until its images' decodes have started, this request counts as on its way to the batcher, so a
        # batch about to start waits for it (up to the batching window).
        self._batcher.announce()
        try:
            # 100 MB takes ~0.2 s: keep it off the loop
            keys = await asyncio.to_thread(_keys, sources[:num_images], sources[num_images:])
            out, pending = self._start_encodes(encoder, sources, keys)
        finally:
            self._batcher.withdraw()
        labels = [f"image {i}" for i in range(num_images)] + [f"video {j}" for j in range(len(request.videos))]
        results = await self._embeddings(keys, labels, out, pending)
        embeddings = [results[h][0] for h in keys]
        if targets:
            t0 = time.monotonic()
            on_host = await self._outbox.push(encoder.device, rid, request.share_host_id, keys, embeddings, targets)
            self.metrics.push_time.observe(time.monotonic() - t0)
        else:
            on_host = await asyncio.to_thread(self._outbox.on_host, embeddings)
        self._outbox.keep(keys, results, on_host)
        response = encoder_pb2.EncodeResponse(request_id=rid)
        for pos, h in enumerate(keys):
            _, grid, hit = results[h]
            item = (response.images if pos < num_images else response.videos).add(
                image_hash=h, num_tokens=encoder.num_tokens(grid), grid_thw=grid, cache_hit=hit)
            if not targets:
                item.embedding.CopyFrom(tensor_to_proto(on_host[pos]))
        hits = sum(results[h][2] for h in keys)
        log.debug("rid=%s encoded %d image(s)%s, %d from cache", rid, num_images,
                  f" and {len(request.videos)} video(s)" if request.videos else "", hits)
        return response

    def _start_encodes(self, encoder: VisionEncoder, sources: list[bytes | encoder_pb2.Video],
                       keys: list[str]) -> tuple[dict[str, tuple[torch.Tensor, list[int], bool]],
                                                 dict[str, asyncio.Future]]:
        """A request's cache hits as ``key -> (embedding, grid_thw, True)``, and a future per other distinct image
        or video (``sources[i]`` has key ``keys[i]``): an encode already in flight for another request, or one
        started here."""
        out: dict[str, tuple[torch.Tensor, list[int], bool]] = {}
        pending: dict[str, asyncio.Future] = {}
        loop = asyncio.get_running_loop()
        for source, h in zip(sources, keys):
            if h in out or h in pending:
                continue
            entry = self.cache.get(h)
            self.metrics.on_cache_lookup(entry is not None)
            if entry is not None:
                out[h] = (entry.embedding, entry.grid_thw, True)
                continue
            fut = self._inflight.get(h)
            if fut is None:
                fut = loop.create_future()
                fut.add_done_callback(_consume_exception)
                self._inflight[h] = fut
                if isinstance(source, bytes):
                    self._batcher.announce()  # taken back by the task: at submit, or if its decode fails
                else:  # a video never joins an image batch: no batch should wait for it
                    self._inflight_videos.add(h)
                # A task, not an inline await: if this request is cancelled, the encode still finishes for the
                # other requests waiting on the same image, and its result still lands in the cache.
                task = asyncio.create_task(self._produce(encoder, h, source, fut))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            pending[h] = fut
        return out, pending

    async def _embeddings(self, keys: list[str], labels: list[str],
                          out: dict[str, tuple[torch.Tensor, list[int], bool]],
                          pending: dict[str, asyncio.Future]) -> dict[str, tuple[torch.Tensor, list[int], bool]]:
        """``key -> (embedding, grid_thw, cache_hit)`` for every distinct image and video of a request (``keys``,
        in request order, named ``labels`` in errors): ``out`` (its cache hits) completed with the outcomes of
        ``pending``.

        Raises:
            RequestError: INVALID_ARGUMENT for the first image or video (in request order) that does not decode or
                is over a limit.
        """
        outcomes = await asyncio.gather(*(asyncio.shield(f) for f in pending.values()), return_exceptions=True)
        done = dict(zip(pending, outcomes))
        for label, h in zip(labels, keys):  # report the first bad one in request order
            if isinstance(done.get(h), (ImageDecodeError, VideoError)):
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{label}: {done[h]}")
        for h, res in done.items():
            if isinstance(res, BaseException):
                raise res
            out[h] = (res[0], res[1], False)
        return out

    async def _produce(self, encoder: VisionEncoder, h: str, source: bytes | encoder_pb2.Video,
                       fut: asyncio.Future) -> None:
        """Decode one image (``bytes``) or video off the loop and encode it through the batcher (an image in its
        next batch, a video as a tower call of its own); resolve ``fut``, fill the cache.

        The outcome depends only on this image's or video's bytes (or a failure of the tower call it joined), so a
        request never gets another request's decode error.
        """
        video = not isinstance(source, bytes)
        try:
            try:
                if video:
                    item = await asyncio.to_thread(decode_video, encoder.video_processor, source.data,
                                                   source.fps or None, source.num_frames or None,
                                                   self._video_limits, self._max_pixels)
                    job, patches = VideoJob(encoder), item.patches
                else:
                    t0 = time.monotonic()
                    item, patches = await asyncio.to_thread(_decode_one, encoder, source, self._max_pixels)
                    self.metrics.decode_time.observe(time.monotonic() - t0)
                    job = encoder
            except BaseException:
                if not video:
                    self._batcher.withdraw()
                raise
            emb, grid = await self._batcher.submit(job, item, patches, announced=not video)
            fut.set_result((emb, grid))
            if not emb.is_cuda:  # on the GPU the requests cache it once pushed (EmbeddingOutbox.keep)
                self.cache.put(h, emb, grid)
        except BaseException as e:
            err = e if isinstance(e, Exception) else RuntimeError("encoding was cancelled (server stopping)")
            if not fut.done():
                fut.set_exception(err)
            if not isinstance(e, Exception):
                raise
        finally:
            if self._inflight.get(h) is fut:
                del self._inflight[h]
                self._inflight_videos.discard(h)

    async def aclose(self) -> None:
        """Cancel encodes still running (their waiters get an error) and wait for them to unwind."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._batcher.aclose()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def serve(config: EncoderConfig, ready: asyncio.Event | None = None) -> None:
    """Run the encoder gRPC server until cancelled.

    The port is bound first with health NOT_SERVING; the model is then loaded on the tower thread, health
    turns SERVING (overall ``""`` and ``epdserve.v1.Encoder``), one INFO line is logged and ``ready`` is set.
    ``config.port == 0`` binds a free port (the log line names it).

    Raises:
        ValueError: bad ``device``/``dtype``, or a checkpoint the vision loader rejects.
        FileNotFoundError: ``model_path`` is not a local checkpoint.
        RuntimeError: the address cannot be bound.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    limit_cpu_threads(device)
    max_bytes = config.max_message_mb * MIB
    server = grpc.aio.server(options=[("grpc.max_send_message_length", max_bytes),
                                      ("grpc.max_receive_message_length", max_bytes)])
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    tower = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epdserve-vision")
    zmq_ctx = zmq.asyncio.Context()
    pusher = EmbeddingPusher(zmq_ctx)
    metrics = EncoderMetrics()
    batcher = EncodeBatcher(tower, config.batch_wait_ms, config.max_batch_patches, metrics=metrics)
    servicer = EncoderServicer(EmbeddingCache(config.cache_size_mb * MIB), pusher, batcher, config.max_image_pixels,
                               metrics, config, VideoLimits(config.max_video_frames, config.max_video_duration_s))
    add_servicer(servicer, server)
    if config.bootstrap_port:  # smg --epd-disaggregation's encode worker (encoder/tokenspeed.py)
        from epdserve.encoder.rooms import RoomServer, RoomStore
        from epdserve.encoder.tokenspeed import add_tokenspeed_services

        rooms = RoomStore(config.room_timeout_s)
        tokenspeed, _ = add_tokenspeed_services(server, servicer, rooms, config)
        metrics.rooms.set_function(lambda: len(rooms))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    async with contextlib.AsyncExitStack() as cleanup:  # unwinds in reverse, every step even if one fails
        cleanup.callback(tower.shutdown, wait=False, cancel_futures=True)
        cleanup.callback(zmq_ctx.term)
        cleanup.callback(pusher.close)
        cleanup.push_async_callback(servicer.aclose)
        cleanup.push_async_callback(server.stop, 1.0)
        cleanup.push_async_callback(health_servicer.enter_graceful_shutdown)
        port = server.add_insecure_port(_bind_address(config.host, config.port))
        metrics_server = start_metrics_server(metrics.registry, config.host, config.metrics_port, "encoder")
        cleanup.callback(metrics_server.close)
        servicer.metrics_port = metrics_server.port
        await server.start()
        loop = asyncio.get_running_loop()
        model_path = await loop.run_in_executor(tower, resolve_model_path, config.model_path)
        encoder = await loop.run_in_executor(tower, VisionEncoder, model_path, device, dtype, config.cuda_graphs,
                                             config.compile, config.gpu_jpeg_decode)
        t1 = time.monotonic()
        await loop.run_in_executor(tower, encoder.warm_up)
        startup = {**encoder.startup_s, "warm-up": time.monotonic() - t1}
        # Test hook: a slow model load (tests check that nothing calls the server ready before this one serves).
        await asyncio.sleep(float(os.environ.get(LOAD_DELAY_ENV, "0")))
        if config.bootstrap_port:  # bound once the model is loaded: a claim needs the tower's device
            room_server = RoomServer(rooms, servicer.outbox, encoder.device, encoder.num_tokens)
            room_server.bind(config.host, config.bootstrap_port)
            cleanup.callback(room_server.close)
            room_task = asyncio.create_task(room_server.run())
            cleanup.push_async_callback(_cancel, room_task)
            cleanup.push_async_callback(tokenspeed.aclose)
        servicer.encoder = encoder
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("encoder ready on %s (model=%s, device=%s, dtype=%s, metrics=%s); %s%s",
                 _bind_address(config.host, port), model_path, device, str(dtype).removeprefix("torch."),
                 metrics_server.url, startup_summary(startup),
                 "; the vision tower compiles beside serving" if encoder.compile_pending else "")
        if encoder.compile_pending:
            compile_beside_serving(encoder, tower)
        if ready is not None:
            ready.set()
        # Shielded: cancelling wait_for_termination() itself leaves grpc's shutdown future cancelled, and the
        # server.stop() below would then raise CancelledError at once instead of stopping the server.
        await asyncio.shield(server.wait_for_termination())


async def _serve_until_signal(config: EncoderConfig) -> None:
    task = asyncio.create_task(serve(config))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def main(config: EncoderConfig) -> None:
    """Run the encoder server in the foreground until SIGINT/SIGTERM, logging at INFO (one line when ready)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve_until_signal(config))


if __name__ == "__main__":
    import argparse

    from epdserve.config import add_config_args, config_from_args

    _parser = argparse.ArgumentParser(description=EncoderConfig.__doc__)
    add_config_args(_parser, EncoderConfig)
    main(config_from_args(EncoderConfig, _parser.parse_args()))
