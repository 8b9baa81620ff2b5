"""ZeroMQ plumbing shared by the servers: typed messages on ROUTER/DEALER/PUSH/PULL sockets."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from epdserve import messages

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

    Returns None when nothing is queued. A malformed message is logged and dropped (returns ``(peer, None)``)
    so one bad peer cannot stop the server.
    """
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    try:
        return frames[0].bytes, messages.decode(frames[1:])
    except messages.WireError as e:
        log.warning("dropped malformed message: %s", e)
        return frames[0], None


def recv(sock: zmq.Socket) -> Any | None:
    """Receive one message on a PULL/DEALER socket without blocking; None when nothing is queued or the
    message is malformed (logged)."""
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    try:
        return messages.decode(frames)
    except messages.WireError as e:
        log.warning("dropped malformed message: %s", e)
        return None


def send(sock: zmq.Socket, msg: Any, identity: bytes | None = None) -> None:
    """Send ``msg`` (a registered message dataclass); on a ROUTER give the peer's ``identity``."""
    frames = messages.encode(msg)
    # copy=False hands tensor memory to ZMQ as is; pyzmq still copies frames under its copy threshold.
    sock.send_multipart([identity, *frames] if identity is not None else frames, copy=False)
