"""The gateway's :class:`~epdserve.frontend.stages.Stages`: the encoders over gRPC, prefill and decode over ZeroMQ.

One :class:`~epdserve.frontend.scheduler_client.SchedulerClient` connects to each of the prefill and decode ROUTER
sockets; both route ``TokenOutput``s into one table of per-request queues. After the startup handshake
:mod:`epdserve.gateway.liveness` watches each stage: a stage that dies or falls silent ends the requests that
depend on it with a 503 within ``--stage-timeout-s`` (at once when its connection drops).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq.asyncio

from epdserve.config import GatewayConfig
from epdserve.frontend.encoder_client import EncoderClient, GrpcEncoderClient, encode_options
from epdserve.frontend.encoders import EncoderPool, parse_encoder_addrs
from epdserve.frontend.errors import StageError
from epdserve.frontend.prompt import EncodedImage, VideoInput
from epdserve.frontend.scheduler_client import OutputRoute, SchedulerClient
from epdserve.gateway.liveness import StageLiveness
from epdserve.wire.messages import DecodeRequest, PrefillRequest, ServerInfo, TokenOutput

logger = logging.getLogger("epdserve.gateway")


class GatewayStages:
    """The :class:`~epdserve.frontend.stages.Stages` of a gateway: connections to the encoder, prefill and decode
    servers, shared by all its requests.

    Lifecycle: :meth:`start` (handshake, may wait for servers still loading), then any number of requests, then
    :meth:`close`. All methods run on the event loop that called :meth:`start`.

    After the handshake each ZMQ stage is watched (:class:`~epdserve.gateway.liveness.StageLiveness`): when one
    goes down, the requests that depend on it end at once with a 503 :class:`StageError` (decode: all of them;
    prefill: those decode has sent nothing for yet, and those still being encoded, whose embeddings go to
    prefill), and new requests get a 503 from :meth:`unavailable` until it answers again.

    Args:
        config: addresses come from ``encoder_addr`` (one or more, comma-separated: an
            :class:`~epdserve.frontend.encoders.EncoderPool` routes between them), ``prefill_addr``, ``decode_addr``;
            ``heartbeat_interval_s`` and ``stage_timeout_s`` set the liveness checks.
        encoder: an :class:`EncoderClient` to use instead of gRPC (tests).
    """

    encodes = True
    sends_before_encoded = True

    def __init__(self, config: GatewayConfig, encoder: EncoderClient | None = None):
        self.config = config
        self.encoder = encoder
        self.prefill_info: ServerInfo | None = None
        self.decode_info: ServerInfo | None = None
        self.liveness: dict[str, StageLiveness] = {}  # "prefill"/"decode" -> its state, once started
        self._ctx: zmq.asyncio.Context | None = None
        self._prefill: SchedulerClient | None = None
        self._decode: SchedulerClient | None = None
        self._routes: dict[str, OutputRoute] = {}  # rid -> its outputs, from either stage

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

    @property
    def bootstrap(self) -> tuple[str, int]:
        """The prefill server's bootstrap address, from its ``ServerInfo``."""
        return self.prefill_info.bootstrap_host, self.prefill_info.bootstrap_port

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
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        self._prefill = SchedulerClient(cfg.prefill_addr, "prefill", ctx=self._ctx, routes=self._routes)
        self._decode = SchedulerClient(cfg.decode_addr, "decode", ctx=self._ctx, routes=self._routes)
        clients = (self._prefill, self._decode)
        handshakes = [asyncio.ensure_future(c.handshake(deadline)) for c in clients]
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
        for client, info in zip(clients, (prefill_info, decode_info)):
            lv = self.liveness[client.role] = StageLiveness(
                client.role, client.addr, client.sock, info, interval_s=cfg.heartbeat_interval_s,
                timeout_s=cfg.stage_timeout_s, on_down=self._on_down, on_up=self._on_up)
            client.start_reader(lv.heard)
        for lv in self.liveness.values():
            lv.start()
        if self.encoder is None:
            pool = EncoderPool([GrpcEncoderClient(a) for a in parse_encoder_addrs(cfg.encoder_addr)],
                               heartbeat_interval_s=cfg.heartbeat_interval_s, stage_timeout_s=cfg.stage_timeout_s)
            self.encoder = pool
            pool.start(max(deadline - time.monotonic(), 1.0))  # text requests need no encoder: serve them meanwhile
        # Set last: `ready` must not turn true before everything above is usable.
        self.prefill_info, self.decode_info = prefill_info, decode_info

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

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None,
                     videos: Sequence[VideoInput] = ()) -> list[EncodedImage]:
        """Encode ``images`` and ``videos`` for ``rid``; the embeddings go straight to every prefill TP rank.

        Args:
            deadline: ``time.monotonic()`` value after which the encode is cancelled (None: no deadline).

        Raises:
            StageError: see :class:`EncoderClient`; 503 before :meth:`start` finished or while (or once) the
                prefill server is down; 504 past ``deadline``.
        """
        if (why := self.unavailable()) is not None:
            raise StageError(why, 503)
        prefill_down = self.liveness["prefill"].went_down() if "prefill" in self.liveness else None
        info = self.prefill_info
        work = asyncio.ensure_future(self.encoder.encode(rid, images, list(info.embed_endpoints),
                                                         **encode_options(videos, info.embed_host_id)))
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

    def send(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> None:
        """Send the request to decode, then prefill, now; its outputs are taken with :meth:`generate`. The gateway
        sends an image request before the encoder has answered: prefill holds it until the embeddings land.

        Raises:
            StageError: 503 when prefill or decode is down or has no connection.
        """
        if (why := self.unavailable()) is not None:
            raise StageError(why, 503)
        self._decode.open(prefill_req.rid)
        # Decode first: it registers with prefill's bootstrap server, and prefill waits for that anyway.
        for client, msg in ((self._decode, decode_req), (self._prefill, prefill_req)):
            if not client.send(msg):
                self.release(prefill_req.rid)
                self.liveness[client.role].mark_down("no connection")
                raise StageError(f"the {client.role} server is unavailable (no connection); retry later", 503)

    async def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                       deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until one has a ``finish_reason``, sending it first (see :meth:`send`)
        unless that was done already. Leaving early leaves the abort to :meth:`release`.

        Args:
            deadline: ``time.monotonic()`` value after which the request is ended (None: no deadline).

        Raises:
            StageError: 503 when prefill or decode is down (or goes down while the request depends on it), 504
                past ``deadline``.
        """
        if prefill_req.rid not in self._routes:
            self.send(prefill_req, decode_req)
        async for out in self._decode.outputs(prefill_req.rid, deadline):
            yield out

    def release(self, rid: str) -> None:
        """``rid`` is over at the gateway: abort it at prefill and decode unless it finished (or was never sent)."""
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
        self._decode.abort(rid)
        self._prefill.abort(rid)

    def abort_choice(self, rid: str, index: int) -> None:
        """Tell decode to stop choice ``index``'s fork of ``rid`` (n > 1; prefill has nothing of it by then)."""
        if self._decode is not None and rid in self._routes:
            self._decode.abort(rid, index)

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
        for client in (self._prefill, self._decode):
            if client is not None:
                await client.close()
        if self.encoder is not None:
            await self.encoder.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self.prefill_info = self.decode_info = None
