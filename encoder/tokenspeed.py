"""The encoder as an encode worker of smg's ``--epd-disaggregation`` mode (``--bootstrap-port``): TokenSpeed's
``TokenSpeedEncoder/Encode`` plus the ``TokenSpeedScheduler`` discovery RPCs smg registers a worker with, on the
encoder's gRPC port beside ``epdserve.v1.Encoder`` (smg-grpc-proto's generated code; the ``smg-grpc`` extra).

smg detects a ``grpc://`` worker's runtime by calling the ``HealthCheck`` of each runtime's scheduler service in
turn (model_gateway/src/workflow/steps/local/detect_backend.rs), so the encoder answers TokenSpeed's, then reads
``GetModelInfo``/``GetServerInfo`` (TokenSpeed's own encode workers serve the same discovery surface,
smg_grpc_servicer/tokenspeed/server.py). ``Generate`` is refused: an encoder has no language model.

``Encode`` carries one image already preprocessed by smg (its patches, grid, placeholder run and content hash) and
one bootstrap room. The item is checked against this checkpoint's processor (INVALID_ARGUMENT on a mismatch), its
embedding looked up in the encoder's cache by the content hash or computed by the vision tower (batched with other
requests' images through the encoder's batcher) and held under the room (:mod:`epdserve.encoder.rooms`) for the
prefill that claims it; the answer (``accepted``) comes at once, as TokenSpeed's.
"""

from __future__ import annotations

import asyncio
import time
from functools import cached_property
from typing import Any

import grpc
import torch
from google.protobuf.struct_pb2 import Struct

from epdserve.encoder.rooms import RoomStore
from epdserve.encoder.vision import PreparedImages
from epdserve.frontend.grpc_tensor import InvalidRequest
from epdserve.frontend.tokenspeed.items import ImageItem, ProcessorLimits, image_item, item_pixels

_IMAGE = 1  # smg.grpc.common.Modality.IMAGE


class PixelJob:
    """The batcher's :class:`~epdserve.encoder.batcher.ImageEncoder` for smg's preprocessed images: one object for
    all of them, so they share tower calls (the batcher batches items of one encoder object). Its items are
    ``(patches [t*h*w, patch_dim], grid_thw)``."""

    def __init__(self, encoder: Any) -> None:
        """``encoder``: the :class:`~epdserve.encoder.vision.VisionEncoder` whose tower runs them."""
        self._encoder = encoder

    def preprocess(self, items: list[tuple[torch.Tensor, list[int]]]) -> PreparedImages:
        """The items' patches as one tower input on the tower's device, cast to its dtype (as transformers'
        ``get_image_features`` casts ``pixel_values``)."""
        enc = self._encoder
        pixels = torch.cat([p for p, _ in items]).to(enc.device).type(enc.dtype)
        ready = None
        if pixels.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return PreparedImages(pixels, [list(g) for _, g in items], ready)

    def run_tower(self, prepared: PreparedImages) -> list[tuple[torch.Tensor, list[int]]]:
        """One ``(embedding, grid_thw)`` per item (``VisionEncoder.run_tower``)."""
        return self._encoder.run_tower(prepared)


class TokenSpeedEncodeServicer:
    """``TokenSpeedEncoder/Encode`` on top of the encoder's :class:`~epdserve.encoder.server.EncoderServicer`
    (``core``: its model, cache, batcher and metrics); images are held in ``rooms``.

    Status codes: INVALID_ARGUMENT (not one item and one room, a bad item), ALREADY_EXISTS (the room is held),
    UNAVAILABLE (the model is loading).
    """

    def __init__(self, core: Any, rooms: RoomStore) -> None:
        self.core, self.rooms = core, rooms
        self._inflight: dict[str, asyncio.Future] = {}  # image hash -> its encode, shared by concurrent rooms
        self._tasks: set[asyncio.Task] = set()

    @cached_property
    def limits(self) -> ProcessorLimits:
        """The loaded checkpoint's image-processor limits."""
        from transformers import AutoConfig

        enc = self.core.encoder
        return ProcessorLimits.of(enc.image_processor, AutoConfig.from_pretrained(enc.model_path).image_token_id)

    @cached_property
    def job(self) -> PixelJob:
        return PixelJob(self.core.encoder)

    async def Encode(self, request, context) -> Any:
        """Check the item, start (or find) its embedding, hold it under the room; answer ``accepted``."""
        from smg_grpc_proto.generated import tokenspeed_encoder_pb2

        core = self.core
        if core.encoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the vision model is still loading")
        if not request.HasField("mm_inputs") or len(request.mm_inputs.items) != 1 or len(request.items) != 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "EncodeRequest must contain exactly one mm item and one room assignment")
        room = request.items[0].bootstrap_room
        with core.metrics.track_request():
            item = request.mm_inputs.items[0]
            try:
                checked = image_item(item, 0, self.limits)
                pixels = item_pixels(item, checked, self.limits)
            except InvalidRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if room in self.rooms:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"bootstrap room {room} is held already")
            core.metrics.images.inc()
            self.rooms.add(room, checked.image_hash, self._embedding(checked, pixels))
        return tokenspeed_encoder_pb2.EncodeResponse(accepted=True)

    def _embedding(self, checked: ImageItem, pixels: torch.Tensor) -> asyncio.Future:
        """The future of the image's ``(embedding, grid_thw)``: from the cache (when its grid is this one), an
        encode already running for another room, or a new one."""
        key, loop = checked.image_hash, asyncio.get_running_loop()
        entry = self.core.cache.get(key)
        hit = entry is not None and list(entry.grid_thw) == checked.grid_thw
        self.core.metrics.on_cache_lookup(hit)
        if hit:
            fut = loop.create_future()
            fut.set_result((entry.embedding, list(entry.grid_thw)))
            return fut
        fut = self._inflight.get(key)
        if fut is None:
            fut = self._inflight[key] = loop.create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: never "never retrieved"
            task = asyncio.create_task(self._produce(key, pixels, checked.grid_thw, fut))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return fut

    async def _produce(self, key: str, pixels: torch.Tensor, grid: list[int], fut: asyncio.Future) -> None:
        try:
            emb, out_grid = await self.core.batcher.submit(self.job, (pixels, grid), grid[0] * grid[1] * grid[2])
            fut.set_result((emb, out_grid))
            if not emb.is_cuda:  # on the GPU the room's push caches its host copy (EmbeddingOutbox.keep)
                self.core.cache.put(key, emb, out_grid)
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else RuntimeError("encoding was cancelled"))
            if not isinstance(e, Exception):
                raise
        finally:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    async def aclose(self) -> None:
        """Cancel encodes still running."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class EncodeDiscoveryServicer:
    """The ``TokenSpeedScheduler`` RPCs smg calls on an encode worker: ``HealthCheck``, ``GetModelInfo``,
    ``GetServerInfo``, ``GetLoads`` (requests in flight; rooms held as waiting), ``GetTokenizer``. ``Generate``:
    FAILED_PRECONDITION; ``SubscribeKvEvents``: UNIMPLEMENTED.
    """

    def __init__(self, core: Any, rooms: RoomStore, config: Any) -> None:
        from smg_grpc_proto.generated import tokenspeed_scheduler_pb2

        self.core, self.rooms, self.config, self.pb = core, rooms, config, tokenspeed_scheduler_pb2
        self.started = time.time()

    async def HealthCheck(self, request, context) -> Any:
        """Healthy once the vision model is loaded."""
        ready = self.core.encoder is not None
        return self.pb.HealthCheckResponse(healthy=ready, message="ok" if ready else "the vision model is loading")

    async def _ready(self, context) -> Any:
        if self.core.encoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the vision model is still loading")
        return self.core.encoder

    async def GetModelInfo(self, request, context) -> Any:
        """The checkpoint, that it takes images, and the pixel dtype smg should send (the tower's)."""
        enc = await self._ready(context)
        dtype = str(enc.dtype).removeprefix("torch.")
        return self.pb.GetModelInfoResponse(
            model_path=enc.model_path, tokenizer_path=enc.model_path, served_model_name=enc.model_path,
            model_type=enc.model_type, supports_vision=True, supports_multimodal=True, supported_modalities=[_IMAGE],
            model_dtype=dtype, multimodal_encoder_dtype=dtype)

    async def GetServerInfo(self, request, context) -> Any:
        """``server_args``: ``disaggregation_mode`` "encode", the bootstrap port, the model path."""
        enc = await self._ready(context)
        from epdserve import __version__

        args = Struct()
        args.update({"model_path": enc.model_path, "tokenizer_path": enc.model_path, "disaggregation_mode": "encode",
                     "disaggregation_bootstrap_port": self.config.bootstrap_port, "port": self.config.port})
        return self.pb.GetServerInfoResponse(server_args=args, active_requests=self.core.num_requests,
                                             uptime_seconds=time.time() - self.started,
                                             tokenspeed_version=f"epdserve-{__version__}")

    async def GetLoads(self, request, context) -> Any:
        """Encode requests in progress as running, rooms held as waiting."""
        load = self.pb.SchedulerLoad(num_running_reqs=self.core.num_requests, num_waiting_reqs=len(self.rooms),
                                     num_total_reqs=self.core.num_requests + len(self.rooms))
        return self.pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        dp_rank_count=1, loads=[load])

    async def Generate(self, request, context):
        """Refused: this is an encode worker."""
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Generate is unavailable on an encode worker")
        yield  # a streaming RPC

    async def GetTokenizer(self, request, context):
        """The checkpoint's tokenizer and processor files as a ZIP (as the prefill and decode workers send it)."""
        from pathlib import Path

        from epdserve.frontend.scheduler_grpc import tokenizer_chunks

        enc = await self._ready(context)
        async for chunk in tokenizer_chunks(Path(enc.model_path)):
            yield chunk

    async def SubscribeKvEvents(self, request, context):
        """UNIMPLEMENTED (smg then stops asking): an encoder has no KV cache."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "an encode worker has no KV cache events")
        yield


def add_tokenspeed_services(server: grpc.aio.Server, core: Any, rooms: RoomStore, config: Any) -> tuple[Any, Any]:
    """Add ``TokenSpeedEncoder`` and the ``TokenSpeedScheduler`` discovery RPCs to ``server``; returns the two
    servicers (the first to close at shutdown).

    Raises:
        ImportError: ``smg-grpc-proto`` is not installed (``pip install 'epdserve[smg-grpc]'``).
    """
    from smg_grpc_proto.generated import (
        tokenspeed_encoder_pb2_grpc, tokenspeed_scheduler_pb2_grpc,
    )

    encode = type("TokenSpeedEncodeServicer", (TokenSpeedEncodeServicer,
                                               tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderServicer), {})(core, rooms)
    discovery = type("EncodeDiscoveryServicer", (EncodeDiscoveryServicer,
                                                 tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer), {})(
        core, rooms, config)
    tokenspeed_encoder_pb2_grpc.add_TokenSpeedEncoderServicer_to_server(encode, server)
    tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server(discovery, server)
    return encode, discovery
