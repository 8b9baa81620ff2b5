"""Pushing embeddings to prefill: one cached ZeroMQ PUSH socket per TP-rank endpoint, bounded queues, and a
deadline after which a target that takes nothing counts as down."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import grpc
import zmq
import zmq.asyncio

from epdserve.encoder.grpc_codec import RequestError

# A target that accepts no message for this long is taken as down: the request fails with UNAVAILABLE rather
# than queueing embeddings for a prefill rank that may never read them.
PUSH_TIMEOUT_S = 10.0
# Messages queued per target before sends wait: embeddings are MBs each, so the default 1000 could hold GBs.
_PUSH_HWM = 64
# Give queued embeddings a moment to leave at shutdown, but never hang on a dead peer.
_PUSH_LINGER_MS = 1000
# Bound on cached PUSH sockets (one per prefill TP rank seen); the least recently used is closed beyond it.
_MAX_PUSH_SOCKETS = 256


async def _sent(sock: zmq.asyncio.Socket, frames: list[bytes | memoryview]) -> None:
    """Queue ``frames`` without copying and wait until ZMQ no longer needs them: written to the connection (a
    queued message is lost if the process dies, one in the kernel's socket buffer is not)."""
    tracker = await sock.send_multipart(frames, copy=False, track=True)
    while not tracker.done:
        await asyncio.sleep(0.0002)


class EmbeddingPusher:
    """ZMQ PUSH sockets to prefill embedding endpoints, connected on first use and cached per endpoint.

    Sockets use ``IMMEDIATE`` so a message is only queued to a live connection: an unreachable target makes
    :meth:`push` fail after ``timeout_s`` instead of silently buffering.
    """

    def __init__(self, context: zmq.asyncio.Context, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        self._ctx = context
        self._timeout_s = timeout_s
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(endpoint)
        if sock is not None:
            self._sockets.move_to_end(endpoint)
            return sock
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, _PUSH_HWM)
        sock.setsockopt(zmq.LINGER, _PUSH_LINGER_MS)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"bad target {endpoint!r}: {e}") from e
        self._sockets[endpoint] = sock
        if len(self._sockets) > _MAX_PUSH_SOCKETS:
            _, oldest = self._sockets.popitem(last=False)
            oldest.close()
        return sock

    def connect(self, endpoints: list[str]) -> list[zmq.asyncio.Socket]:
        """The (cached or new) socket of each endpoint; connecting early lets TCP setup overlap the encode.

        Raises:
            RequestError: INVALID_ARGUMENT for a malformed endpoint.
        """
        return [self._socket(e) for e in endpoints]

    async def push(self, endpoints: list[str], messages: list[list[bytes | memoryview]]) -> None:
        """Send ``messages[i]`` (a multipart message) to ``endpoints[i]``, concurrently; return once every message
        has left this process (ZMQ has written it to the connection), so that an encoder killed after answering
        loses no embeddings that its answer announced.

        Raises:
            RequestError: INVALID_ARGUMENT for a malformed endpoint, UNAVAILABLE for one that accepted nothing
                within the timeout (the others may have received the message).
        """
        socks = list(zip(endpoints, self.connect(endpoints), messages, strict=True))

        async def one(endpoint: str, sock: zmq.asyncio.Socket, frames: list[bytes | memoryview]) -> None:
            try:
                await asyncio.wait_for(_sent(sock, frames), self._timeout_s)
            except TimeoutError as e:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"target {endpoint!r} accepted no embeddings within {self._timeout_s:g} s",
                                   logging.WARNING) from e

        results = await asyncio.gather(*(one(*target) for target in socks), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    @property
    def num_sockets(self) -> int:
        """PUSH sockets open now (at most ``_MAX_PUSH_SOCKETS``)."""
        return len(self._sockets)

    def close(self) -> None:
        """Close every socket (each lingers up to 1 s for queued messages)."""
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
