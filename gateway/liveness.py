"""Liveness of the prefill and decode servers as one gateway sees them: heartbeats plus ZeroMQ connection events.

A stage is **down** from the moment

- its TCP connection drops (a ``ZMQ_EVENT_DISCONNECTED`` on the gateway's DEALER socket: a killed or crashed
  process is noticed at once), or
- it has sent nothing for ``timeout_s`` seconds although it gets a ``LoadRequest`` every ``interval_s``
  seconds (a hung, stopped or unreachable process),

and **up** again once it answers a ``ServerInfoRequest`` with the right role (a restarted process rejoins by
itself: ZeroMQ reconnects, the gateway re-handshakes). Every message from the stage counts as a sign of life; the
``Load`` replies to the heartbeats are kept for the gateway's health details.

The gateway's socket uses ``ZMQ_IMMEDIATE``, so nothing is queued for a stage with no connection: sends fail at
once with ``zmq.Again`` and the request gets a 503 instead of waiting for a process that may never come back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epdserve.frontend.scheduler_client import try_send
from epdserve.wire.messages import Load, LoadRequest, ServerInfo, ServerInfoRequest

logger = logging.getLogger("epdserve.gateway")


class StageLiveness:
    """Up/down state of one ZMQ stage (``role`` "prefill" or "decode") behind the gateway's DEALER ``sock``.

    Call :meth:`heard` with every message read from ``sock``; :meth:`start` runs the heartbeat and the connection
    event watcher. ``on_down(role, reason)`` runs (on the event loop) each time the stage goes down, ``on_up(info)``
    each time it comes back with a fresh :class:`ServerInfo`.

    Args:
        role: the stage's role, checked against its ``ServerInfo``.
        addr: its endpoint, for messages.
        sock: the gateway's DEALER socket connected to it.
        info: the handshake answer (the stage starts up), or None for a server that has not answered yet (it
            starts down and comes up on its first ``ServerInfo``, as a restarted one does).
        interval_s: seconds between heartbeats.
        timeout_s: seconds of silence after which the stage is taken as down.
    """

    def __init__(self, role: str, addr: str, sock: zmq.asyncio.Socket, info: ServerInfo | None, *,
                 interval_s: float, timeout_s: float, on_down: Callable[[str, str], None],
                 on_up: Callable[[ServerInfo], None]):
        self.role, self.addr, self.sock = role, addr, sock
        self.info = info
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._on_down, self._on_up = on_down, on_up
        self.up = info is not None
        self.reason = "" if self.up else "has not answered yet"  # why it is down
        self.changed_at = time.monotonic()
        self.last_seen = time.monotonic()
        self.load: Load | None = None
        self._down = asyncio.get_running_loop().create_future()  # resolved when the stage goes down
        if not self.up:
            self._down.set_result(self.reason)
        self._load_waiters: list[asyncio.Future] = []
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Start the heartbeat and the connection-event watcher."""
        loop = asyncio.get_running_loop()
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._events(monitor))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass

    def went_down(self) -> asyncio.Future:
        """A future resolved (with the reason) when the stage next goes down; already resolved while it is down.
        Do not cancel it: it is shared."""
        return self._down

    def heard(self, msg: Any) -> None:
        """Note a message from the stage: it is alive; a ``Load`` is kept, a ``ServerInfo`` brings it back up."""
        self.last_seen = time.monotonic()
        if isinstance(msg, Load):
            self.load = msg
            waiters, self._load_waiters = self._load_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(msg)
        elif isinstance(msg, ServerInfo):
            if msg.role != self.role:
                self.mark_down(f"{self.addr} now answers as a {msg.role!r} server")
                return
            self.info = msg
            if not self.up:
                self.up, self.reason, self.changed_at = True, "", time.monotonic()
                self._down = asyncio.get_running_loop().create_future()
                logger.info("%s server at %s is up again", self.role, self.addr)
                self._on_up(msg)

    def mark_down(self, reason: str) -> None:
        """Take the stage as down (idempotent) and tell ``on_down``."""
        if not self.up:
            return
        self.up, self.reason, self.changed_at = False, reason, time.monotonic()
        self.load = None
        logger.warning("%s server at %s is down: %s", self.role, self.addr, reason)
        self._down.set_result(reason)
        self._on_down(self.role, reason)

    async def fresh_load(self, timeout_s: float = 1.0) -> Load | None:
        """Ask for a ``Load`` now and return the next one that arrives (None if the stage is down or silent)."""
        if not self.up:
            return None
        fut = asyncio.get_running_loop().create_future()
        self._load_waiters.append(fut)
        if not try_send(self.sock, LoadRequest()):
            self._load_waiters.remove(fut)
            return None
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return None

    def status(self) -> dict[str, Any]:
        """JSON-ready state for the gateway's health details."""
        now = time.monotonic()
        out: dict[str, Any] = {"addr": self.addr, "up": self.up, "last_seen_s_ago": round(now - self.last_seen, 3)}
        if not self.up:
            out |= {"reason": self.reason, "down_for_s": round(now - self.changed_at, 3)}
        if self.load is not None:
            out["load"] = {k: v for k, v in vars(self.load).items() if k != "role"}
        return out

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # Replies already waiting on the socket mean the stage is alive and only this event loop was slow to
            # read them (a stalled gateway must not take a stage for dead).
            if self.up and time.monotonic() - self.last_seen > self.timeout_s and not self._replies_waiting():
                self.mark_down(f"no answer for {self.timeout_s:g} s")
            # While down, the question is whether a (new) server answers the handshake.
            try_send(self.sock, LoadRequest() if self.up else ServerInfoRequest())

    def _replies_waiting(self) -> bool:
        try:
            return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    async def _events(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await monitor.recv_multipart()
                try:
                    event = parse_monitor_message(frames)["event"]
                except Exception:  # the heartbeat still covers this stage
                    continue
                if event == zmq.EVENT_DISCONNECTED:
                    self.mark_down("connection lost")
                elif event == zmq.EVENT_CONNECTED:
                    try_send(self.sock, ServerInfoRequest())  # a restarted server: handshake at once
        finally:
            monitor.close(linger=0)
