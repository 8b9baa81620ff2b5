"""The gateway's side of the stage protocol: the encoder over gRPC, prefill and decode over ZeroMQ.

One ``zmq.asyncio`` DEALER connects to each of the prefill and decode ROUTER sockets. Requests and replies are
``epdserve.messages`` frames. After the startup handshake (``ServerInfoRequest`` -> ``ServerInfo``) a reader task
per socket routes every ``TokenOutput`` (alone or in a ``TokenOutputBatch``) to the queue of its request id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import zmq
import zmq.asyncio

from epdserve.config import GatewayConfig
from epdserve.gateway.prompt import EncodedImage
from epdserve.messages import (
    AbortRequest, DecodeRequest, PrefillRequest, ServerInfo, ServerInfoRequest, TokenOutput, TokenOutputBatch,
    WireError, decode, encode,
)

logger = logging.getLogger("epdserve.gateway")

_GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class StageError(Exception):
    """A stage refused or failed a request. ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.message = message
        self.status = status


class EncoderClient(Protocol):
    """What the gateway needs from an encoder (the gRPC client below, or a fake in tests)."""

    async def encode(self, rid: str, images: list[bytes], targets: list[str]) -> list[EncodedImage]:
        """Encode ``images`` and push their embeddings for ``rid`` to every endpoint in ``targets``.

        Raises:
            StageError: 400 for an image the encoder rejects, 503 when it is unreachable or past a deadline (an
                :class:`~epdserve.gateway.encoders.EncoderPool` then takes it as down), 500 otherwise.
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

    async def encode(self, rid: str, images: list[bytes], targets: list[str]) -> list[EncodedImage]:
        """See :class:`EncoderClient`."""
        grpc = self._grpc
        req = self._pb2.EncodeRequest(request_id=rid, images=[self._pb2.Image(data=b) for b in images],
                                      targets=targets)
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
        if len(resp.images) != len(images):
            raise StageError(f"encoder returned {len(resp.images)} results for {len(images)} images", 500)
        return [EncodedImage(r.image_hash, r.num_tokens, list(r.grid_thw)) for r in resp.images]

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

    async def close(self) -> None:
        await self._channel.close()


class StageClient:
    """Connections to the encoder, prefill and decode servers, shared by all requests of one gateway.

    Lifecycle: :meth:`start` (handshake, may wait for servers still loading), then any number of :meth:`encode`
    and :meth:`generate`, then :meth:`close`. All methods run on the event loop that called :meth:`start`.

    Args:
        config: addresses come from ``encoder_addr`` (one or more, comma-separated: an
            :class:`~epdserve.gateway.encoders.EncoderPool` routes between them), ``prefill_addr``, ``decode_addr``.
        encoder: an :class:`EncoderClient` to use instead of gRPC (tests).
    """

    def __init__(self, config: GatewayConfig, encoder: EncoderClient | None = None):
        self.config = config
        self.encoder = encoder
        self.prefill_info: ServerInfo | None = None
        self.decode_info: ServerInfo | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._prefill: zmq.asyncio.Socket | None = None
        self._decode: zmq.asyncio.Socket | None = None
        self._routes: dict[str, asyncio.Queue[TokenOutput]] = {}  # rid -> its outputs
        self._readers: list[asyncio.Task] = []
        self._sends: set[asyncio.Task] = set()  # abort sends in flight (referenced so they are not collected)

    @property
    def ready(self) -> bool:
        """True once both prefill and decode have answered the handshake."""
        return self.prefill_info is not None and self.decode_info is not None

    @property
    def context_length(self) -> int:
        """Longest prompt + completion in tokens that both prefill and decode accept."""
        if not self.ready:
            raise StageError("stages are not ready", 503)
        return min(self.prefill_info.context_length, self.decode_info.context_length)

    async def start(self, timeout_s: float = 300.0) -> None:
        """Connect and handshake with prefill and decode (and the encoder), retrying until ``timeout_s``.

        Raises:
            TimeoutError: a server (or every encoder) did not answer in time.
            StageError: a server answered with the wrong role.
            ValueError: no address in ``config.encoder_addr``.
        """
        deadline = time.monotonic() + timeout_s
        self._ctx = zmq.asyncio.Context()
        self._prefill = self._connect(self.config.prefill_addr)
        self._decode = self._connect(self.config.decode_addr)
        handshakes = [
            asyncio.ensure_future(self._handshake(self._prefill, "prefill", self.config.prefill_addr, deadline)),
            asyncio.ensure_future(self._handshake(self._decode, "decode", self.config.decode_addr, deadline)),
        ]
        try:
            # On the first failure the other handshake is cancelled, not left polling a socket close() destroys.
            await asyncio.wait(handshakes, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in handshakes:
                task.cancel()
            await asyncio.gather(*handshakes, return_exceptions=True)
        for task in handshakes:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        prefill_info, decode_info = (task.result() for task in handshakes)
        loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read_loop(sock)) for sock in (self._prefill, self._decode)]
        if self.encoder is None:
            from epdserve.gateway.encoders import EncoderPool, parse_encoder_addrs  # it imports this module

            pool = EncoderPool([GrpcEncoderClient(a) for a in parse_encoder_addrs(self.config.encoder_addr)])
            self.encoder = pool
            await pool.wait_ready(max(deadline - time.monotonic(), 1.0))
        # Set last: `ready` must not turn true before everything above is usable.
        self.prefill_info, self.decode_info = prefill_info, decode_info

    def _connect(self, addr: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        return sock

    async def _handshake(self, sock: zmq.asyncio.Socket, role: str, addr: str, deadline: float) -> ServerInfo:
        # Re-ask every few seconds: a request sent before the server bound may be dropped on reconnect. Extra
        # ServerInfo replies that arrive later are ignored by the reader loop.
        while True:
            await sock.send_multipart(encode(ServerInfoRequest()))
            wait_until = min(time.monotonic() + 2.0, deadline)
            while (left := wait_until - time.monotonic()) > 0:
                if not await sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    continue
                try:
                    msg = decode(await sock.recv_multipart())
                except WireError as e:
                    logger.warning("bad message from %s server at %s: %s", role, addr, e)
                    continue
                if isinstance(msg, ServerInfo):
                    if msg.role != role:
                        raise StageError(f"{addr} is a {msg.role!r} server, expected {role!r}")
                    logger.debug("%s server at %s: %s", role, addr, msg)
                    return msg
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{role} server at {addr} did not answer")
            logger.debug("waiting for the %s server at %s", role, addr)

    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = decode(frames)
            except WireError as e:
                logger.warning("dropped a malformed message from a stage: %s", e)
                continue
            if isinstance(msg, TokenOutputBatch):
                for out in msg.outputs:
                    self._route(out)
            elif isinstance(msg, TokenOutput):
                self._route(msg)
            elif not isinstance(msg, ServerInfo):  # late handshake replies are expected
                logger.warning("unexpected %s from a stage", type(msg).__name__)

    def _route(self, out: TokenOutput) -> None:
        queue = self._routes.get(out.rid)
        if queue is not None:  # outputs of finished or aborted requests are dropped
            queue.put_nowait(out)

    async def encode(self, rid: str, images: list[bytes]) -> list[EncodedImage]:
        """Encode ``images`` for ``rid``; the embeddings go straight to every prefill TP rank.

        Raises:
            StageError: see :class:`EncoderClient`; 503 before :meth:`start` finished.
        """
        if not self.ready:
            raise StageError("stages are not ready", 503)
        return await self.encoder.encode(rid, images, list(self.prefill_info.embed_endpoints))

    async def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> AsyncIterator[TokenOutput]:
        """Send the request to decode, then prefill, and yield its outputs until one has a ``finish_reason``.

        If the iteration stops early (client gone, task cancelled, generator closed) an ``AbortRequest`` goes to
        both servers. Use it under ``contextlib.aclosing`` so that happens promptly.
        """
        rid = prefill_req.rid
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._routes[rid] = queue
        finished = False
        try:
            # Decode first: it registers with prefill's bootstrap server, and prefill waits for that anyway.
            await self._decode.send_multipart(encode(decode_req))
            await self._prefill.send_multipart(encode(prefill_req))
            while True:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._routes.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        """Tell prefill and decode to drop ``rid`` (unknown ids are the servers' to ignore).

        Synchronous on purpose: it runs in ``finally`` blocks of cancelled tasks, where an ``await`` could be
        cancelled again. The sends happen in a separate task.
        """
        if self._prefill is None:
            return
        logger.debug("rid=%s abort", rid)
        task = asyncio.get_running_loop().create_task(self._send_all(encode(AbortRequest(rid))))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send_all(self, frames: list[Any]) -> None:
        for sock in (self._prefill, self._decode):
            try:
                await sock.send_multipart(frames)
            except zmq.ZMQError as e:
                logger.warning("could not send an abort: %s", e)

    async def close(self) -> None:
        """Stop the readers, flush pending aborts briefly, close sockets and the encoder channel."""
        if self._sends:
            await asyncio.wait(list(self._sends), timeout=1.0)
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._readers = []
        if self.encoder is not None:
            await self.encoder.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self.prefill_info = self.decode_info = None
