"""ZeroMQ plumbing shared by the servers: typed messages on ROUTER/DEALER/PUSH/PULL sockets."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from epdserve.wire import messages
from epdserve.wire.validate import check_message

log = logging.getLogger(__name__)


def bind(ctx: zmq.Context, kind: int, host: str, port: int) -> zmq.Socket:
    """Create a socket of ``kind`` bound to ``tcp://host:port`` (no linger, unbounded queues)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(f"tcp://{host}:{port}")
    return sock


def connect(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    """Create a socket of ``kind`` connected to ``endpoint`` (no linger, unbounded queues)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    return sock


def recv_routed(sock: zmq.Socket) -> tuple[bytes, Any] | None:
    """Receive one message on a ROUTER socket without blocking: ``(peer identity, message)``.

    Returns None when nothing is queued. A malformed message (see :func:`decode_checked`) is logged and dropped
    (returns ``(peer, None)``) so one bad peer cannot stop the server.
    """
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    return frames[0].bytes, decode_checked(frames[1:])


def recv(sock: zmq.Socket) -> Any | None:
    """Receive one message on a PULL/DEALER socket without blocking; None when nothing is queued or the
    message is malformed (logged)."""
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    return decode_checked(frames)


def decode_checked(frames: list) -> Any | None:
    """:func:`~epdserve.wire.messages.decode` then :func:`~epdserve.wire.validate.check_message`; None (logged
    at WARNING) for frames that are not a well-formed message, whatever the decoder raised (msgpack nesting deep
    enough to hit the recursion limit raises RecursionError, not WireError)."""
    try:
        return check_message(messages.decode(frames))
    except Exception as e:
        log.warning("dropped malformed message: %s", str(e)[:300])
        return None


def send(sock: zmq.Socket, msg: Any, identity: bytes | None = None) -> None:
    """Send ``msg`` (a registered message dataclass); on a ROUTER give the peer's ``identity``."""
    frames = messages.encode(msg)
    # copy=False hands tensor memory to ZMQ as is; pyzmq still copies frames under its copy threshold.
    sock.send_multipart([identity, *frames] if identity is not None else frames, copy=False)


MAX_CACHED_SOCKETS = 256


def connect_cached(ctx: zmq.Context, kind: int, endpoint: str, sockets: dict[str, zmq.Socket]) -> zmq.Socket | None:
    """The socket for ``endpoint`` in ``sockets``, connected (and added) on first use; beyond
    ``MAX_CACHED_SOCKETS`` the least recently used one is closed (``sockets`` is kept in use order).

    Returns None, logged, when ZMQ rejects the endpoint: it came from another process (a decode server's KV
    endpoint, a request's bootstrap address), and a bad one must fail that request, not the server.
    """
    sock = sockets.pop(endpoint, None)
    if sock is None:
        try:
            sock = connect(ctx, kind, endpoint)
        except zmq.ZMQError as e:
            log.warning("cannot connect to %r: %s", endpoint[:200], e)
            return None
        if len(sockets) >= MAX_CACHED_SOCKETS:
            sockets.pop(next(iter(sockets))).close(linger=0)
    sockets[endpoint] = sock  # (re)inserted last: the most recently used
    return sock
