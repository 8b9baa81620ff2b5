"""The encoder's client: what the front end needs from an encoder (:class:`EncoderClient`) and its gRPC
implementation (:class:`GrpcEncoderClient`); :class:`~epdserve.frontend.encoders.EncoderPool` routes between
several."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from epdserve.frontend.errors import StageError
from epdserve.frontend.prompt import EncodedImage, VideoInput

_GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def encode_options(videos: Sequence[VideoInput] = (), share_host_id: str = "") -> dict:
    """The optional keywords of an :meth:`EncoderClient.encode` call, each only when set, so that an image request
    also reaches an encoder client that predates them (a test's fake)."""
    return {k: v for k, v in (("videos", list(videos)), ("share_host_id", share_host_id)) if v}


class EncoderClient(Protocol):
    """What the gateway needs from an encoder (the gRPC client below, or a fake in tests)."""

    async def encode(self, rid: str, images: list[bytes], targets: list[str],
                     videos: Sequence[VideoInput] = (), share_host_id: str = "") -> list[EncodedImage]:
        """Encode ``images`` and ``videos`` and push their embeddings for ``rid`` to every endpoint in ``targets``
        (through GPU memory when ``share_host_id``, the targets' ``ServerInfo.embed_host_id``, is the encoder's).

        Returns one :class:`EncodedImage` per image, then one per video (hash = :func:`epdserve.hashing.video_key`,
        ``num_tokens`` all of the video's rows, ``grid_thw`` ``[t, h, w]``), in request order.

        Raises:
            StageError: 400 for an image or video the encoder rejects, 503 when it is unreachable or past a deadline (an
                :class:`~epdserve.frontend.encoders.EncoderPool` then takes it as down), 500 otherwise.
        """
        ...

    async def close(self) -> None: ...


class GrpcEncoderClient:
    """``epdserve.v1.Encoder/Encode`` over a ``grpc.aio`` channel (messages up to 256 MiB each way)."""

    def __init__(self, addr: str, max_message_bytes: int = _GRPC_MAX_MESSAGE_BYTES):
        import grpc

        # Imported lazily: the generated stubs are only needed when a real encoder is used.
        from epdserve.proto import encoder_pb2, encoder_pb2_grpc

        self._grpc = grpc
        self._pb2 = encoder_pb2
        self._channel = grpc.aio.insecure_channel(addr, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # gRPC's default reconnect backoff grows to 120 s: an encoder that restarts would stay unreachable
            # from this channel (and its health probes) long after it serves again.
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.min_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ])
        self._stub = encoder_pb2_grpc.EncoderStub(self._channel)
        self.addr = addr

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the channel connects. Raises ``TimeoutError`` after ``timeout_s`` seconds."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    async def encode(self, rid: str, images: list[bytes], targets: list[str],
                     videos: Sequence[VideoInput] = (), share_host_id: str = "") -> list[EncodedImage]:
        """See :class:`EncoderClient`. A video's unset ``fps`` / ``num_frames`` travel as proto3's 0 (unset)."""
        grpc = self._grpc
        pb2 = self._pb2
        req = pb2.EncodeRequest(request_id=rid, images=[pb2.Image(data=b) for b in images], targets=targets,
                                videos=[pb2.Video(data=v.data, fps=v.fps or 0.0, num_frames=v.num_frames or 0)
                                        for v in videos], share_host_id=share_host_id)
        try:
            resp = await self._stub.Encode(req)
        except grpc.aio.AioRpcError as e:
            code, detail = e.code(), e.details() or str(e.code())
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise StageError(detail, 400) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise StageError(f"encoder: {detail}", 413) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StageError(f"encoder {self.addr} unavailable: {detail}", 503) from None
            raise StageError(f"encoder failed ({code.name}): {detail}", 500) from None
        if len(resp.images) != len(images) or len(resp.videos) != len(videos):
            raise StageError(f"encoder returned {len(resp.images)} results for {len(images)} images and "
                             f"{len(resp.videos)} for {len(videos)} videos", 500)
        return [EncodedImage(r.image_hash, r.num_tokens, list(r.grid_thw)) for r in (*resp.images, *resp.videos)]

    async def serving(self) -> bool:
        """True when the encoder's ``grpc.health.v1`` check says SERVING within 1 s; False otherwise."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except self._grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def server_info(self) -> dict:
        """The encoder's ``GetServerInfo`` as a dict (proto field names; every field, zeros included).

        Raises:
            grpc.aio.AioRpcError: the call failed.
        """
        from google.protobuf.json_format import MessageToDict

        resp = await self._stub.GetServerInfo(self._pb2.GetServerInfoRequest(), timeout=5)
        out = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        # proto3's JSON mapping writes int64 as strings; this answer is for people and dashboards.
        int64 = {f.name for f in resp.DESCRIPTOR.fields if f.cpp_type == f.CPPTYPE_INT64}
        return {k: int(v) if k in int64 else v for k, v in out.items()}

    async def load(self) -> dict[str, int] | None:
        """The encoder's ``GetLoad`` answer as a dict (requests/images in flight, cache entries and bytes, push
        sockets), or None when it does not answer within 1 s."""
        try:
            resp = await self._stub.GetLoad(self._pb2.EncoderLoadRequest(), timeout=1)
        except self._grpc.aio.AioRpcError:
            return None
        return {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}

    async def close(self) -> None:
        await self._channel.close()
