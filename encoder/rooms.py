"""The encoder's bootstrap rooms (smg ``--epd-disaggregation``): each image smg sends with ``TokenSpeedEncoder/
Encode`` is held under its bootstrap room until the prefill server smg chose claims it on the encoder's bootstrap
port (:mod:`epdserve.wire.room_messages`), then pushed to that server's TP ranks like any embedding
(:class:`~epdserve.encoder.outbox.EmbeddingOutbox`).

smg dispatches the encode and the prefill leg at once, so a claim may come before its room exists: it waits for it
(up to the claim's ``wait_s``). smg never tells an encoder that a request was abandoned, so a room nobody claims is
dropped ``timeout_s`` after it was made, and a room given up (a claim without targets: the request was aborted)
before it was made is remembered as given up for as long, so that its late Encode holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
import zmq.asyncio

from epdserve.encoder.grpc_codec import RequestError
from epdserve.encoder.outbox import EmbeddingOutbox
from epdserve.wire import room_messages
from epdserve.wire.room_messages import EmbedClaim, EmbedClaimReply

log = logging.getLogger("epdserve.encoder")


class _ClaimFailed(Exception):
    """A claim answered with HTTP-style ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Room:
    """One held image: ``result`` is the future of its ``(embedding, grid_thw)`` (shared with other rooms of the
    same image), dropped at ``deadline`` (``time.monotonic()``) unless claimed."""

    image_hash: str
    result: asyncio.Future
    deadline: float


class RoomStore:
    """Rooms by number; touched from the event loop only.

    Args:
        timeout_s: how long an unclaimed room (or the memory of a given-up one) is kept.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._rooms: dict[int, Room] = {}
        self._given_up: dict[int, float] = {}  # room -> until when its Encode is ignored
        self._waiters: dict[int, list[asyncio.Future]] = {}  # claims that came before their room

    def __len__(self) -> int:
        """Rooms held now."""
        return len(self._rooms)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def add(self, room: int, image_hash: str, result: asyncio.Future) -> None:
        """Hold ``result`` under ``room`` (nothing if the room was given up); wake the claims waiting for it."""
        if self._given_up.pop(room, None) is not None:
            return
        entry = self._rooms[room] = Room(image_hash, result, time.monotonic() + self.timeout_s)
        for w in self._waiters.pop(room, []):
            if not w.done():
                w.set_result(entry)

    async def take(self, room: int, wait_s: float) -> Room:
        """Remove and return ``room``, waiting up to ``wait_s`` seconds for it to be made.

        Raises:
            TimeoutError: it was not made in time.
        """
        entry = self._rooms.pop(room, None)
        if entry is not None:
            return entry
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(room, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, wait_s)
        finally:
            waiting = self._waiters.get(room, [])
            if waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._waiters[room]
        return self._rooms.pop(room)

    def give_up(self, room: int) -> None:
        """Drop ``room``, or, not made yet, drop it as soon as it is (a claim still waiting for it ends)."""
        if self._rooms.pop(room, None) is None:
            self._given_up[room] = time.monotonic() + self.timeout_s
        for w in self._waiters.pop(room, []):
            w.cancel()

    def expire(self) -> list[int]:
        """Drop the rooms (and memories of given-up ones) past their time; returns the rooms dropped."""
        now = time.monotonic()
        gone = [r for r, e in self._rooms.items() if e.deadline < now]
        for r in gone:
            del self._rooms[r]
        for r in [r for r, t in self._given_up.items() if t < now]:
            del self._given_up[r]
        return gone


class RoomServer:
    """The bootstrap port: a ZeroMQ ROUTER bound to ``host``:``port`` answering :class:`EmbedClaim` s.

    Args:
        store: the rooms.
        outbox: pushes embeddings to prefill ranks (and caches what it moved off the GPU).
        device: the tower's device (CUDA IPC applies to embeddings there).
        num_tokens: tokens (embedding rows) of a ``[t, h, w]`` grid.
    """

    def __init__(self, store: RoomStore, outbox: EmbeddingOutbox, device: torch.device,
                 num_tokens: Callable[[list[int]], int]) -> None:
        self.store, self._outbox, self._device, self._num_tokens = store, outbox, device, num_tokens
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()

    def bind(self, host: str, port: int) -> None:
        """Bind the port.

        Raises:
            zmq.ZMQError: it cannot be bound.
        """
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        self._sock = sock

    async def run(self) -> None:
        """Answer claims (each on a task of its own) and expire rooms, until cancelled."""
        expiry = asyncio.create_task(self._expire_loop())
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                ident = frames[0].bytes
                try:
                    claim = room_messages.decode(frames[1:])
                    if not isinstance(claim, EmbedClaim):
                        raise TypeError(f"{type(claim).__name__} is not a claim")
                except Exception as e:  # one bad peer must not stop the port
                    log.warning("bootstrap port: dropped a malformed message: %s", str(e)[:300])
                    continue
                if not claim.targets:
                    self.store.give_up(claim.room)
                    continue
                task = asyncio.create_task(self._claim(ident, claim))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            expiry.cancel()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(expiry, *self._tasks, return_exceptions=True)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.store.timeout_s / 4))
            for room in self.store.expire():
                log.info("bootstrap room %d was never claimed within %g s: dropped", room, self.store.timeout_s)

    async def _claim(self, ident: bytes, claim: EmbedClaim) -> None:
        reply = EmbedClaimReply(claim.room)
        deadline = time.monotonic() + claim.wait_s
        try:
            try:
                room = await self.store.take(claim.room, claim.wait_s)
            except TimeoutError:
                raise _ClaimFailed(504, f"no Encode for this room within {claim.wait_s:g} s") from None
            if room.image_hash != claim.image_hash:
                reply.status, reply.error = 400, (f"the room holds image {room.image_hash[:16]}, not "
                                                  f"{claim.image_hash[:16]}")
            else:
                try:
                    emb, grid = await asyncio.wait_for(asyncio.shield(room.result),
                                                       max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise _ClaimFailed(504, f"its encode did not finish within {claim.wait_s:g} s") from None
                try:
                    on_host = await self._outbox.push(self._device, claim.rid, claim.share_host_id, [room.image_hash],
                                                      [emb], claim.targets)
                except RequestError as e:  # a target took nothing (503) or is malformed (400)
                    raise _ClaimFailed(503 if e.code.name == "UNAVAILABLE" else 400, str(e)) from None
                self._outbox.keep([room.image_hash], {room.image_hash: (emb, grid, False)}, on_host)
                reply.num_tokens, reply.grid_thw = self._num_tokens(grid), list(grid)
        except _ClaimFailed as e:
            reply.status, reply.error = e.status, str(e)
        except Exception as e:  # the encode failed (its error is the tower's)
            log.warning("rid=%s room %d: %s", claim.rid, claim.room, e)
            reply.status, reply.error = 500, f"encoding failed: {type(e).__name__}: {e}"
        await self._sock.send_multipart([ident, *room_messages.encode(reply)])

    def close(self) -> None:
        """Close the port."""
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()
