"""The gateway's side of the stage protocol: the encoder over gRPC, prefill and decode over ZeroMQ.

One ``zmq.asyncio`` DEALER connects to each of the prefill and decode ROUTER sockets. Requests and replies are
``epdserve.wire.messages`` frames. After the startup handshake (``ServerInfoRequest`` -> ``ServerInfo``) a reader task
per socket routes every ``TokenOutput`` (alone or in a ``TokenOutputBatch``) to the queue of its request id, and
:mod:`epdserve.gateway.liveness` watches each stage: a stage that dies or falls silent ends the requests that
depend on it with a 503 within ``--stage-timeout-s`` (at once when its connection drops).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import zmq
import zmq.asyncio

from epdserve.config import GatewayConfig
from epdserve.gateway.prompt import EncodedImage
from epdserve.gateway.liveness import StageLiveness, try_send
from epdserve.wire.messages import (
    AbortRequest, DecodeRequest, Load, PrefillRequest, ServerInfo, ServerInfoRequest, TokenOutput, TokenOutputBatch,
    WireError, decode,
)
from epdserve.wire.validate import check_message

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


@dataclass
class OutputRoute:
    """Where the outputs of one request in flight go: ``items`` holds TokenOutputs, or a StageError that ends the
    request; ``wake`` is set whenever an item is added."""

    items: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    started: bool = False  # decode has sent an output: prefill is done with this request

    def put(self, item: TokenOutput | StageError) -> None:
        self.items.append(item)
        self.wake.set()

    async def take(self, timeout: float | None) -> TokenOutput:
        """The next output; outputs that queued up meanwhile come merged into one (their token ids and logprobs
        joined, the last one's counts and finish reason), so a gateway that falls behind a decode step sends fewer,
        larger SSE events instead of a growing backlog of one-token events.

        Raises:
            StageError: the request ended on a stage error (after the outputs queued before it were taken).
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        while not self.items:
            self.wake.clear()
            await asyncio.wait_for(self.wake.wait(), timeout)
        item = self.items.popleft()
        if isinstance(item, StageError):
            raise item
        if not self.items or not isinstance(self.items[0], TokenOutput) or item.finish_reason is not None:
            return item
        ids, logprobs = list(item.token_ids), list(item.logprobs)
        while self.items and isinstance(self.items[0], TokenOutput) and item.finish_reason is None:
            item = self.items.popleft()
            ids += item.token_ids
            logprobs += item.logprobs
        return replace(item, token_ids=ids, logprobs=logprobs)


class StageClient:
    """Connections to the encoder, prefill and decode servers, shared by all requests of one gateway.

    Lifecycle: :meth:`start` (handshake, may wait for servers still loading), then any number of :meth:`encode`
    and :meth:`generate`, then :meth:`close`. All methods run on the event loop that called :meth:`start`.

    After the handshake each ZMQ stage is watched (:class:`~epdserve.gateway.liveness.StageLiveness`): when one
    goes down, the requests that depend on it end at once with a 503 :class:`StageError` (decode: all of them;
    prefill: those decode has sent nothing for yet, and those still being encoded, whose embeddings go to
    prefill), and new requests get a 503 from :meth:`unavailable` until it answers again.

    Args:
        config: addresses come from ``encoder_addr`` (one or more, comma-separated: an
            :class:`~epdserve.gateway.encoders.EncoderPool` routes between them), ``prefill_addr``, ``decode_addr``;
            ``heartbeat_interval_s`` and ``stage_timeout_s`` set the liveness checks.
        encoder: an :class:`EncoderClient` to use instead of gRPC (tests).
    """

    def __init__(self, config: GatewayConfig, encoder: EncoderClient | None = None):
        self.config = config
        self.encoder = encoder
        self.prefill_info: ServerInfo | None = None
        self.decode_info: ServerInfo | None = None
        self.liveness: dict[str, StageLiveness] = {}  # "prefill"/"decode" -> its state, once started
        self._ctx: zmq.asyncio.Context | None = None
        self._prefill: zmq.asyncio.Socket | None = None
        self._decode: zmq.asyncio.Socket | None = None
        self._routes: dict[str, OutputRoute] = {}  # rid -> its outputs
        self._readers: list[asyncio.Task] = []

    @property
    def ready(self) -> bool:
        """True once both prefill and decode have answered the handshake."""
        return self.prefill_info is not None and self.decode_info is not None

    @property
    def context_length(self) -> int:
        """Longest prompt + completion in tokens that both prefill and decode accept, and that fits their KV
        pools (decode reserves pages for the whole output at admission: a request larger than its pool could
        never run)."""
        if not self.ready:
            raise StageError("stages are not ready", 503)
        p, d = self.prefill_info, self.decode_info
        return min(p.context_length, d.context_length, p.num_pages * p.page_size, d.num_pages * d.page_size)

    def unavailable(self) -> str | None:
        """Why a new request cannot be served now (not started, or prefill or decode down), or None."""
        if not self.ready:
            return "the server is starting: the stages are not ready yet"
        for role in ("prefill", "decode"):
            lv = self.liveness.get(role)
            if lv is not None and not lv.up:
                return f"the {role} server is unavailable ({lv.reason}); retry later"
        return None

    def not_ready(self) -> str | None:
        """Why this gateway cannot serve every kind of request it accepts now (``GET /health`` answers 503 with
        it), or None: a reason of :meth:`unavailable`, or no encoder serving. Text requests are still served
        while only the encoders are missing."""
        why = self.unavailable()
        if why is None and (not_serving := getattr(self.encoder, "not_serving", None)) is not None:
            why = not_serving()
        return why

    async def start(self, timeout_s: float = 300.0) -> None:
        """Connect and handshake with prefill and decode (and the encoder), retrying until ``timeout_s``; then
        start the liveness checks.

        Raises:
            TimeoutError: prefill or decode did not answer in time (the encoders are waited for in the
                background: see ``not_ready``).
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
        cfg = self.config
        for role, sock, info, addr in (("prefill", self._prefill, prefill_info, cfg.prefill_addr),
                                       ("decode", self._decode, decode_info, cfg.decode_addr)):
            self.liveness[role] = StageLiveness(role, addr, sock, info, interval_s=cfg.heartbeat_interval_s,
                                                timeout_s=cfg.stage_timeout_s, on_down=self._on_down,
                                                on_up=self._on_up)
        self._readers = [loop.create_task(self._read_loop(self._prefill, self.liveness["prefill"])),
                         loop.create_task(self._read_loop(self._decode, self.liveness["decode"]))]
        for lv in self.liveness.values():
            lv.start()
        if self.encoder is None:
            from epdserve.gateway.encoders import EncoderPool, parse_encoder_addrs  # it imports this module

            pool = EncoderPool([GrpcEncoderClient(a) for a in parse_encoder_addrs(cfg.encoder_addr)],
                               heartbeat_interval_s=cfg.heartbeat_interval_s, stage_timeout_s=cfg.stage_timeout_s)
            self.encoder = pool
            pool.start(max(deadline - time.monotonic(), 1.0))  # text requests need no encoder: serve them meanwhile
        # Set last: `ready` must not turn true before everything above is usable.
        self.prefill_info, self.decode_info = prefill_info, decode_info

    def _connect(self, addr: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a stage without a live connection: sends fail at once (see liveness.try_send).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        # ... and never refuse a send to a connected one for queue length: admission control bounds the requests.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(addr)
        return sock

    async def _handshake(self, sock: zmq.asyncio.Socket, role: str, addr: str, deadline: float) -> ServerInfo:
        # Re-ask every few seconds (every 0.1 s while there is no connection to send on). Extra ServerInfo replies
        # that arrive later are taken by the reader loop.
        while True:
            sent = try_send(sock, ServerInfoRequest())
            wait_until = min(time.monotonic() + (2.0 if sent else 0.1), deadline)
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

    async def _read_loop(self, sock: zmq.asyncio.Socket, liveness: StageLiveness) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = check_message(decode(frames))
            except Exception as e:  # whatever a broken stage sends, the reader must keep routing
                logger.warning("dropped a malformed message from the %s server: %s", liveness.role, str(e)[:300])
                continue
            liveness.heard(msg)
            if isinstance(msg, TokenOutputBatch):
                for out in msg.outputs:
                    self._route(out)
            elif isinstance(msg, TokenOutput):
                self._route(msg)
            elif not isinstance(msg, (ServerInfo, Load)):
                logger.warning("unexpected %s from the %s server", type(msg).__name__, liveness.role)

    def _route(self, out: TokenOutput) -> None:
        route = self._routes.get(out.rid)
        if route is not None:  # outputs of finished or aborted requests are dropped
            route.started = True
            route.put(out)

    def _on_down(self, role: str, reason: str) -> None:
        err = StageError(f"the {role} server went down ({reason}); retry later", 503)
        failed = 0
        for route in self._routes.values():
            if role == "decode" or not route.started:
                route.put(err)
                failed += 1
        if failed:
            logger.warning("%d request(s) in flight ended: the %s server is down", failed, role)

    def _on_up(self, info: ServerInfo) -> None:
        if info.role == "prefill":
            self.prefill_info = info
        else:
            self.decode_info = info

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None) -> list[EncodedImage]:
        """Encode ``images`` for ``rid``; the embeddings go straight to every prefill TP rank.

        Args:
            deadline: ``time.monotonic()`` value after which the encode is cancelled (None: no deadline).

        Raises:
            StageError: see :class:`EncoderClient`; 503 before :meth:`start` finished or while (or once) the
                prefill server is down; 504 past ``deadline``.
        """
        if (why := self.unavailable()) is not None:
            raise StageError(why, 503)
        prefill_down = self.liveness["prefill"].went_down() if "prefill" in self.liveness else None
        work = asyncio.ensure_future(self.encoder.encode(rid, images, list(self.prefill_info.embed_endpoints)))
        waits = {work} if prefill_down is None else {work, prefill_down}
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work in done:
            return work.result()
        if prefill_down is not None and prefill_down in done:
            raise StageError(f"the prefill server went down ({prefill_down.result()}); retry later", 503)
        raise StageError("the request did not finish within the server's deadline (while encoding images)", 504)

    def dispatch(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> None:
        """Send the request to decode, then prefill, now; its outputs are taken with :meth:`generate`. The gateway
        dispatches an image request before the encoder has answered: prefill holds it until the embeddings land.
        Whoever dispatches ends the request with :meth:`generate` (to its end or closed early) or :meth:`release`.

        Raises:
            StageError: 503 when prefill or decode is down or has no connection.
        """
        if (why := self.unavailable()) is not None:
            raise StageError(why, 503)
        self._routes[prefill_req.rid] = OutputRoute()
        # Decode first: it registers with prefill's bootstrap server, and prefill waits for that anyway.
        for role, sock, msg in (("decode", self._decode, decode_req), ("prefill", self._prefill, prefill_req)):
            if not try_send(sock, msg):
                self.release(prefill_req.rid)
                self.liveness[role].mark_down("no connection")
                raise StageError(f"the {role} server is unavailable (no connection); retry later", 503)

    async def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                       deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until one has a ``finish_reason``, dispatching it first (see
        :meth:`dispatch`) unless that was done already.

        If the iteration stops early (client gone, task cancelled, generator closed, error) an ``AbortRequest``
        goes to both servers. Use it under ``contextlib.aclosing`` so that happens promptly.

        Args:
            deadline: ``time.monotonic()`` value after which the request is ended (None: no deadline).

        Raises:
            StageError: 503 when prefill or decode is down (or goes down while the request depends on it), 504
                past ``deadline``.
        """
        rid = prefill_req.rid
        if rid not in self._routes:
            self.dispatch(prefill_req, decode_req)
        route = self._routes[rid]
        finished = False
        try:
            while True:
                timeout = None if deadline is None else deadline - time.monotonic()
                try:
                    item = await route.take(timeout)
                except TimeoutError:
                    raise StageError("the request did not finish within the server's deadline", 504) from None
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._routes.pop(rid, None)
            if not finished:
                self.abort(rid)

    def release(self, rid: str) -> None:
        """End a dispatched request whose outputs nobody will take (its client left before :meth:`generate`
        began): abort it on the stages. Does nothing for a request that has ended."""
        if self._routes.pop(rid, None) is not None:
            self.abort(rid)

    def abort(self, rid: str) -> None:
        """Tell prefill and decode to drop ``rid`` (unknown ids are the servers' to ignore); a stage with no
        connection is skipped (a restarted one has nothing of ``rid``). Synchronous: it runs in ``finally`` blocks
        of cancelled tasks."""
        self._routes.pop(rid, None)
        if self._prefill is None:
            return
        logger.debug("rid=%s abort", rid)
        for sock in (self._prefill, self._decode):
            try_send(sock, AbortRequest(rid))

    @property
    def num_inflight(self) -> int:
        """Requests sent to prefill/decode and not finished."""
        return len(self._routes)

    async def health(self, fresh: bool = False) -> dict[str, Any]:
        """Every stage's liveness and load, JSON-ready: ``{"prefill": {...}, "decode": {...}, "encoders": [...]}``.

        Args:
            fresh: ask prefill and decode for their ``Load`` now (up to 1 s) instead of the last heartbeat's.
        """
        if fresh:
            await asyncio.gather(*(lv.fresh_load() for lv in self.liveness.values()))
        out: dict[str, Any] = {role: lv.status() for role, lv in self.liveness.items()}
        status = getattr(self.encoder, "status", None)
        out["encoders"] = await status() if status is not None else []
        return out

    async def close(self) -> None:
        """Stop the liveness checks and readers, close sockets and the encoder channel."""
        for lv in self.liveness.values():
            await lv.stop()
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
