"""The one ZeroMQ client of a scheduler loop (a prefill or decode server's ``--zmq-port`` ROUTER socket).

The gateway holds one per stage (prefill, decode), a prefill or decode HTTP front one for its own server. Messages
are ``epdserve.wire.messages`` frames. After the ``ServerInfoRequest`` -> ``ServerInfo`` handshake a reader task
routes every ``TokenOutput`` (alone or in a ``TokenOutputBatch``) to the :class:`OutputRoute` of its request id and
each ``Load`` to the oldest :meth:`SchedulerClient.load` waiting for one. Aborts are sent by whoever ends a request
(its :class:`~epdserve.frontend.lifetime.RequestLifetime`, through the stages).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from epdserve.frontend.errors import StageError
from epdserve.wire.messages import (
    AbortRequest, Load, LoadRequest, ServerInfo, ServerInfoRequest, TokenOutput, TokenOutputBatch, WireError, decode,
    encode,
)
from epdserve.wire.validate import check_message
from epdserve.frontend import logger


def try_send(sock: zmq.asyncio.Socket, msg: Any) -> bool:
    """Send ``msg`` without waiting; False when the socket has no live connection to take it (``ZMQ_IMMEDIATE``)
    or is closed."""
    try:
        fut = sock.send_multipart(encode(msg), flags=zmq.NOBLOCK)
    except (zmq.Again, zmq.ZMQError):
        return False
    # With NOBLOCK the send has happened (or failed) already; the future only carries the outcome.
    if fut.done() and fut.exception() is not None:
        return False
    return True


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
        joined, the last one's counts and finish reason), so a front that falls behind a decode step sends fewer,
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
        if not self._merges(item):
            return item
        ids, logprobs = list(item.token_ids), list(item.logprobs)
        while self._merges(item):
            item = self.items.popleft()
            ids += item.token_ids
            logprobs += item.logprobs
        return replace(item, token_ids=ids, logprobs=logprobs)

    def _merges(self, item: TokenOutput) -> bool:
        """Whether the next queued output continues ``item`` (the same choice, ``item`` not its last)."""
        nxt = self.items[0] if self.items else None
        return isinstance(nxt, TokenOutput) and item.finish_reason is None and nxt.index == item.index


class SchedulerClient:
    """A DEALER socket connected to one scheduler loop, and the routes of the requests sent on it.

    All methods run on one event loop. Lifecycle: :meth:`handshake`, :meth:`start_reader`, then any number of
    :meth:`open` + :meth:`send` + :meth:`outputs` (ended by :meth:`drop` / :meth:`abort`), :meth:`load`, then
    :meth:`close`.

    Args:
        addr: the scheduler's ZMQ endpoint.
        role: "prefill" or "decode": the role its ``ServerInfo`` must name.
        ctx: the ``zmq.asyncio`` context (the client makes and destroys its own when None).
        routes: per-request output queues, rid -> route; the gateway shares one between its prefill and decode
            clients, since a request's outputs may come from either.
        immediate: queue nothing for a server without a live connection (``ZMQ_IMMEDIATE``: sends fail at once, so a
            gateway answers 503 instead of waiting for a process that may never come back). A front, started before
            its server binds, lets messages wait for the connection instead.
    """

    def __init__(self, addr: str, role: str, *, ctx: zmq.asyncio.Context | None = None,
                 routes: dict[str, OutputRoute] | None = None, immediate: bool = True):
        self.addr, self.role = addr, role
        self.info: ServerInfo | None = None  # the handshake's answer, once the owner takes it
        self.routes = routes if routes is not None else {}
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if immediate:
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        # Never refuse a send for queue length: admission control (or the router) bounds the requests.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(addr)
        self._loads: list[asyncio.Future[Load]] = []
        self._reader: asyncio.Task | None = None
        self._on_message: Callable[[Any], None] | None = None

    def send(self, msg: Any) -> bool:
        """Send ``msg`` now; False when it cannot go (no live connection with ``immediate``, or closed)."""
        return try_send(self.sock, msg)

    async def handshake(self, deadline: float | None = None) -> ServerInfo:
        """Ask for ``ServerInfo`` until the scheduler answers (it may still be loading its model): every 2 s, every
        0.1 s while there is no connection to send on. Extra answers that arrive later go to the reader.

        Args:
            deadline: ``time.monotonic()`` value to give up at (None: never).

        Raises:
            TimeoutError: no answer by ``deadline``.
            StageError: the socket belongs to a server of another role.
        """
        while True:
            sent = self.send(ServerInfoRequest())
            wait_until = time.monotonic() + (2.0 if sent else 0.1)
            if deadline is not None:
                wait_until = min(wait_until, deadline)
            while (left := wait_until - time.monotonic()) > 0:
                if not await self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    continue
                try:
                    msg = decode(await self.sock.recv_multipart())
                except WireError as e:
                    logger.warning("bad message from %s server at %s: %s", self.role, self.addr, e)
                    continue
                if isinstance(msg, ServerInfo):
                    if msg.role != self.role:
                        raise StageError(f"{self.addr} is a {msg.role!r} server, expected {self.role!r}")
                    logger.debug("%s server at %s: %s", self.role, self.addr, msg)
                    return msg
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.role} server at {self.addr} did not answer")
            logger.debug("waiting for the %s server at %s", self.role, self.addr)

    def start_reader(self, on_message: Callable[[Any], None] | None = None) -> None:
        """Start routing what the scheduler sends; ``on_message(msg)`` sees every valid message first (the
        gateway's liveness: any message is a sign of life)."""
        self._on_message = on_message
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = check_message(decode(frames))
            except Exception as e:  # whatever a broken stage sends, the reader must keep routing
                logger.warning("dropped a malformed message from the %s server: %s", self.role, str(e)[:300])
                continue
            if self._on_message is not None:
                self._on_message(msg)
            if isinstance(msg, TokenOutputBatch):
                for out in msg.outputs:
                    self._route(out)
            elif isinstance(msg, TokenOutput):
                self._route(msg)
            elif isinstance(msg, Load):
                while self._loads:
                    fut = self._loads.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
                        break
            elif not isinstance(msg, ServerInfo):
                logger.warning("unexpected %s from the %s server", type(msg).__name__, self.role)

    def _route(self, out: TokenOutput) -> None:
        route = self.routes.get(out.rid)
        if route is not None:  # outputs of finished or aborted requests are dropped
            route.started = True
            route.put(out)

    def open(self, rid: str) -> OutputRoute:
        """A new route for ``rid``'s outputs (call before sending its request, so no output is missed)."""
        route = self.routes[rid] = OutputRoute()
        return route

    async def outputs(self, rid: str, deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Yield the outputs of ``rid`` (opened with :meth:`open`) until one ends the request; the route is
        dropped then. Leaving early leaves the route to whoever ends the request (:meth:`drop`).

        Raises:
            StageError: the request ended on a stage error; 504 when nothing came by ``deadline``
                (``time.monotonic()`` value, None: none).
        """
        route = self.routes[rid]
        while True:
            timeout = None if deadline is None else deadline - time.monotonic()
            try:
                out = await route.take(timeout)
            except TimeoutError:
                raise StageError("the request did not finish within the server's deadline", 504) from None
            if out.ends_request:  # n > 1: after every choice's finish
                self.routes.pop(rid, None)
                yield out
                return
            yield out

    def drop(self, rid: str) -> bool:
        """Forget ``rid``'s route; True when it had one (the request was sent and has not finished)."""
        return self.routes.pop(rid, None) is not None

    def abort(self, rid: str, index: int | None = None) -> None:
        """Tell the scheduler to drop ``rid`` (with ``index``: only that choice's fork, decode) (unknown ids are its
        to ignore; a server with no connection is skipped: a restarted one has nothing of ``rid``). Synchronous: it
        runs in ``finally`` blocks of cancelled tasks."""
        self.send(AbortRequest(rid, index))

    async def load(self, timeout_s: float = 5.0) -> Load:
        """The scheduler's current :class:`Load`.

        Raises:
            TimeoutError: no answer within ``timeout_s`` seconds (the loop is busy or gone).
        """
        fut = asyncio.get_running_loop().create_future()
        self._loads.append(fut)
        self.send(LoadRequest())
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            if fut in self._loads:
                self._loads.remove(fut)

    async def close(self) -> None:
        """Stop the reader and close the socket (and the context, if the client made it)."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self.sock.close(linger=0)
        if self._own_ctx:
            self._ctx.destroy(linger=0)
