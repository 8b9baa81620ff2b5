"""The gateway's :class:`~epdserve.frontend.stages.Stages`: the encoders over gRPC, one or more prefill and decode
servers over ZeroMQ.

One :class:`~epdserve.frontend.scheduler_client.SchedulerClient` connects to each prefill and decode server's
ROUTER socket; all of them route ``TokenOutput``s into one table of per-request queues. Each request is placed on
one prefill and one decode server when it is sent (:class:`~epdserve.gateway.dispatch.Dispatcher`); the encoder
pushes its embeddings to that prefill server's TP ranks and decode takes its KV from that prefill's bootstrap
address. After the start-up handshake :mod:`epdserve.gateway.liveness` watches each server on its own: one that
dies or falls silent ends the requests placed on it with a 503 within ``--stage-timeout-s`` (at once when its
connection drops) and takes no new ones until it answers again; the others keep serving.
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
from epdserve.gateway.dispatch import Dispatcher, Placement, unavailable_reason
from epdserve.gateway.liveness import StageLiveness
from epdserve.gateway.routing import CacheAwareConfig
from epdserve.gateway.servers import LMServer, handshake_all
from epdserve.wire.messages import DecodeRequest, PrefillRequest, ServerInfo, TokenOutput

logger = logging.getLogger("epdserve.gateway")


class GatewayStages:
    """The :class:`~epdserve.frontend.stages.Stages` of a gateway: connections to the encoders and to every prefill
    and decode server, shared by all its requests.

    Lifecycle: :meth:`start` (handshake, may wait for servers still loading), then any number of requests, then
    :meth:`close`. All methods run on the event loop that called :meth:`start`.

    When a server goes down, the requests placed on it end at once with a 503 :class:`StageError` (decode: all of
    them; prefill: those decode has sent nothing for yet, and those whose embeddings are being encoded for it), and
    new requests go to the others; with none of a role up, new requests get a 503 from :meth:`unavailable`.

    Args:
        config: addresses come from ``encoder_addr`` (one or more, comma-separated: an
            :class:`~epdserve.frontend.encoders.EncoderPool` routes between them), ``prefill_addr`` and
            ``decode_addr`` (lists); ``heartbeat_interval_s`` and ``stage_timeout_s`` set the liveness checks, the
            ``cache_threshold``/``balance_*``/``routing_tree_pages`` fields the choice of prefill server.
        encoder: an :class:`EncoderClient` to use instead of gRPC (tests).
    """

    encodes = True
    sends_before_encoded = True

    def __init__(self, config: GatewayConfig, encoder: EncoderClient | None = None):
        self.config = config
        self.encoder = encoder
        self.prefills: list[LMServer] = []
        self.decodes: list[LMServer] = []
        self.dispatcher: Dispatcher | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._started = False
        self._routes: dict[str, OutputRoute] = {}  # rid -> its outputs, from any server
        self._placed: dict[str, Placement] = {}  # rid -> where it runs, from send() to release()
        # rid -> the prefill server its embeddings went to before it was sent (the only one up then).
        self._pinned: dict[str, int] = {}
        self._placing: dict[str, asyncio.Future[Placement]] = {}  # rid -> its placement, awaited by encode()

    @property
    def ready(self) -> bool:
        """True once at least one prefill and one decode server have answered the handshake."""
        return self._started

    @property
    def servers(self) -> list[LMServer]:
        """Every prefill server, then every decode server."""
        return [*self.prefills, *self.decodes]

    def infos(self) -> list[ServerInfo]:
        """The ``ServerInfo`` of every server that has answered at least once."""
        return [s.info for s in self.servers if s.info is not None]

    @property
    def context_length(self) -> int:
        """Longest prompt + completion in tokens that every server accepts and that fits every KV pool (decode
        reserves pages for the whole output at admission: a request larger than its pool could never run)."""
        if not self.ready:
            raise StageError("stages are not ready", 503)
        return min(min(i.context_length, i.num_pages * i.page_size) for i in self.infos())

    @property
    def bootstrap(self) -> None:
        """None: each request's bootstrap address is its prefill server's, set when it is placed (:meth:`send`)."""
        return None

    def unavailable(self) -> str | None:
        """Why a new request cannot be served now (not started, or no prefill or no decode server up), or None."""
        if not self.ready:
            return "the server is starting: the stages are not ready yet"
        return unavailable_reason("prefill", self.prefills) or unavailable_reason("decode", self.decodes)

    def not_ready(self) -> str | None:
        """Why this gateway cannot serve every kind of request it accepts now (``GET /health`` answers 503 with
        it), or None: a reason of :meth:`unavailable`, or no encoder serving. Text requests are still served
        while only the encoders are missing."""
        why = self.unavailable()
        if why is None and (not_serving := getattr(self.encoder, "not_serving", None)) is not None:
            why = not_serving()
        return why

    async def start(self, timeout_s: float = 300.0) -> None:
        """Connect and handshake with the prefill and decode servers (and the encoders), retrying until
        ``timeout_s``; then start the liveness checks. A server that has not answered once one of each role has
        (and a short grace after) starts down and joins when it answers.

        Raises:
            TimeoutError: no prefill or no decode server answered in time (the encoders are waited for in the
                background: see ``not_ready``).
            StageError: a server answered with the wrong role.
            ValueError: no address in ``config.encoder_addr``.
        """
        deadline = time.monotonic() + timeout_s
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        for role, addrs, servers in (("prefill", cfg.prefill_addr, self.prefills),
                                     ("decode", cfg.decode_addr, self.decodes)):
            servers[:] = [LMServer(i, role, SchedulerClient(a, role, ctx=self._ctx, routes=self._routes))
                          for i, a in enumerate(addrs)]
        infos = await handshake_all(self.servers, deadline)
        for server, info in zip(self.servers, infos):
            if info is None:
                logger.warning("%s has not answered yet: serving without it until it does", server.describe())
            server.liveness = StageLiveness(
                server.role, server.addr, server.client.sock, info, interval_s=cfg.heartbeat_interval_s,
                timeout_s=cfg.stage_timeout_s, on_down=lambda _, why, s=server: self._on_down(s, why),
                on_up=lambda _, s=server: self._on_up(s))
            server.client.start_reader(server.liveness.heard)
        for server in self.servers:
            server.liveness.start()
        page_size = next(i.page_size for s, i in zip(self.servers, infos) if s.role == "prefill" and i is not None)
        self.dispatcher = Dispatcher(self.prefills, self.decodes, self._routes, CacheAwareConfig(
            cache_threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
            balance_rel_threshold=cfg.balance_rel_threshold, page_size=page_size, max_pages=cfg.routing_tree_pages))
        if self.encoder is None:
            pool = EncoderPool([GrpcEncoderClient(a) for a in parse_encoder_addrs(cfg.encoder_addr)],
                               heartbeat_interval_s=cfg.heartbeat_interval_s, stage_timeout_s=cfg.stage_timeout_s)
            self.encoder = pool
            pool.start(max(deadline - time.monotonic(), 1.0))  # text requests need no encoder: serve them meanwhile
        # Set last: `ready` must not turn true before everything above is usable.
        self._started = True

    def _on_down(self, server: LMServer, reason: str) -> None:
        err = StageError(f"the {server.describe()} went down ({reason}); retry later", 503)
        failed = 0
        for rid, placed in self._placed.items():
            route = self._routes.get(rid)
            if route is None:
                continue
            if (server.role == "decode" and placed.decode == server.index) or \
                    (server.role == "prefill" and placed.prefill == server.index and not route.started):
                route.put(err)
                failed += 1
        if server.role == "prefill" and self.dispatcher is not None:
            self.dispatcher.forget(server.index)  # a server that comes back has lost its cache
        if failed:
            logger.warning("%d request(s) in flight ended: the %s is down", failed, server.describe())

    def _on_up(self, server: LMServer) -> None:
        if server.role == "prefill" and self.dispatcher is not None:
            self.dispatcher.forget(server.index)

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None,
                     videos: Sequence[VideoInput] = ()) -> list[EncodedImage]:
        """Encode ``images`` and ``videos`` for ``rid``; the embeddings go straight to every TP rank of its prefill
        server. With several prefill servers up that server is chosen from the prompt, so this waits until
        :meth:`send` has placed the request (the prompt is built while the images are fetched); with one, it
        starts at once.

        Args:
            deadline: ``time.monotonic()`` value after which the encode is cancelled (None: no deadline).

        Raises:
            StageError: see :class:`EncoderClient`; 503 before :meth:`start` finished or while (or once) its
                prefill server is down; 504 past ``deadline``.
        """
        if (why := self.unavailable()) is not None:
            raise StageError(why, 503)
        server = await self._embedding_target(rid, deadline)
        prefill_down = server.liveness.went_down()
        info = server.info
        work = asyncio.ensure_future(self.encoder.encode(rid, images, list(info.embed_endpoints),
                                                         **encode_options(videos, info.embed_host_id)))
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            done, _ = await asyncio.wait({work, prefill_down}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work in done:
            return work.result()
        if prefill_down in done:
            raise StageError(f"the {server.describe()} went down ({prefill_down.result()}); retry later", 503)
        raise StageError("the request did not finish within the server's deadline (while encoding images)", 504)

    async def _embedding_target(self, rid: str, deadline: float | None) -> LMServer:
        """The prefill server ``rid``'s embeddings go to: its placement's, or the only one up (pinned for
        :meth:`send`), or the one :meth:`send` chooses (waited for until ``deadline``)."""
        if (placed := self._placed.get(rid)) is not None:
            return self.prefills[placed.prefill]
        up = [s for s in self.prefills if s.up]
        if len(up) == 1:
            self._pinned[rid] = up[0].index
            return up[0]
        placing = self._placing.setdefault(rid, asyncio.get_running_loop().create_future())
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            placed = await asyncio.wait_for(placing, timeout)
        except TimeoutError:
            raise StageError("the request did not finish within the server's deadline (before encoding)", 504) from None
        return self.prefills[placed.prefill]

    def send(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> None:
        """Place the request on a prefill and a decode server and send it to decode, then prefill, now; its outputs
        are taken with :meth:`generate`. The gateway sends an image request before the encoder has answered:
        prefill holds it until the embeddings land.

        Raises:
            StageError: 503 when no prefill or decode server is up, or the chosen one has no connection.
        """
        if (why := self.unavailable()) is not None:
            raise StageError(why, 503)
        rid = prefill_req.rid
        placed = self.dispatcher.place(prefill_req, self._pinned.get(rid))
        pre, dec = self.prefills[placed.prefill], self.decodes[placed.decode]
        self._placed[rid] = placed
        pre.rids.add(rid)
        dec.rids.add(rid)
        logger.debug("rid=%s placed on prefill %d and decode %d", rid, placed.prefill, placed.decode)
        if (placing := self._placing.pop(rid, None)) is not None and not placing.done():
            placing.set_result(placed)
        dec.client.open(rid)
        # Decode first: it registers with prefill's bootstrap server, and prefill waits for that anyway.
        for server, msg in ((dec, placed.decode_request(decode_req)), (pre, prefill_req)):
            if not server.client.send(msg):
                self.release(rid)
                server.liveness.mark_down("no connection")
                raise StageError(f"the {server.describe()} is unavailable (no connection); retry later", 503)

    async def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                       deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until one has a ``finish_reason``, sending it first (see :meth:`send`)
        unless that was done already. Leaving early leaves the abort to :meth:`release`.

        Args:
            deadline: ``time.monotonic()`` value after which the request is ended (None: no deadline).

        Raises:
            StageError: 503 when no server is up, or one the request depends on goes down; 504 past ``deadline``.
        """
        rid = prefill_req.rid
        if rid not in self._routes:
            self.send(prefill_req, decode_req)
        async for out in self.decodes[self._placed[rid].decode].client.outputs(rid, deadline):
            yield out

    def release(self, rid: str) -> None:
        """``rid`` is over at the gateway: abort it at its servers unless it finished (or was never sent), and
        forget where it ran."""
        if self._routes.pop(rid, None) is not None:
            self.abort(rid)
        self._forget(rid)

    def abort(self, rid: str) -> None:
        """Tell the servers that may hold something of ``rid`` to drop it (unknown ids are theirs to ignore); a
        server with no connection is skipped (a restarted one has nothing of ``rid``). Synchronous: it runs in
        ``finally`` blocks of cancelled tasks."""
        self._routes.pop(rid, None)
        if (placing := self._placing.pop(rid, None)) is not None:
            placing.cancel()
        placed = self._placed.get(rid)
        if placed is not None:
            targets = [self.decodes[placed.decode], self.prefills[placed.prefill]]
        elif (pinned := self._pinned.get(rid)) is not None:
            targets = [self.prefills[pinned]]  # its embeddings may be there already
        else:
            return  # never sent, and no embedding went anywhere
        logger.debug("rid=%s abort", rid)
        for server in targets:
            server.client.abort(rid)

    def _forget(self, rid: str) -> None:
        self._pinned.pop(rid, None)
        if (placing := self._placing.pop(rid, None)) is not None:
            placing.cancel()
        if (placed := self._placed.pop(rid, None)) is not None:
            self.prefills[placed.prefill].rids.discard(rid)
            self.decodes[placed.decode].rids.discard(rid)

    def abort_choice(self, rid: str, index: int) -> None:
        """Tell decode to stop choice ``index``'s fork of ``rid`` (n > 1; prefill has nothing of it by then)."""
        if rid in self._routes and (placed := self._placed.get(rid)) is not None:
            self.decodes[placed.decode].client.abort(rid, index)

    @property
    def num_inflight(self) -> int:
        """Requests sent to prefill/decode and not finished."""
        return len(self._routes)

    async def health(self, fresh: bool = False) -> dict[str, Any]:
        """Every server's liveness and load, JSON-ready: ``{"prefill": [...], "decode": [...], "encoders": [...]}``,
        one entry per server in flag order (:meth:`LMServer.status`).

        Args:
            fresh: ask the servers that are up for their ``Load`` now (up to 1 s) instead of the last heartbeat's.
        """
        if fresh:
            await asyncio.gather(*(s.liveness.fresh_load() for s in self.servers if s.liveness is not None))
        out: dict[str, Any] = {"prefill": [s.status() for s in self.prefills],
                               "decode": [s.status() for s in self.decodes]}
        status = getattr(self.encoder, "status", None)
        out["encoders"] = await status() if status is not None else []
        return out

    async def close(self) -> None:
        """Stop the liveness checks and readers, close sockets and the encoder channel."""
        self._started = False
        for server in self.servers:
            if server.liveness is not None:
                await server.liveness.stop()
        for server in self.servers:
            await server.client.close()
        if self.encoder is not None:
            await self.encoder.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
