"""The prefill front's side of smg's EPD rendezvous: claim each image's embedding from the encoder bootstrap room
smg named (``encode_bootstrap_info``), to be pushed to this server's TP ranks (:mod:`epdserve.wire.room_messages`).

One ZeroMQ DEALER per encoder bootstrap address, connected on first use and cached; a reader task per socket
hands each reply to the claim waiting for its room. A claim that is cancelled (the request was aborted, smg
dropped the stream) or fails gives its room up at the encoder, so nothing stays held there for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import zmq
import zmq.asyncio

from epdserve.frontend.errors import StageError
from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.scheduler_requests import EncodeRoom
from epdserve.wire import room_messages
from epdserve.wire.room_messages import EmbedClaim, EmbedClaimReply

log = logging.getLogger("epdserve.front")

_MAX_SOCKETS = 256  # encoder bootstrap addresses kept connected; the least recently used is closed beyond it
_REPLY_GRACE_S = 5.0  # beyond a claim's wait_s: the encoder answers a timed-out claim itself (504) first


def endpoint(host: str, port: int) -> str:
    """The ZeroMQ endpoint of a bootstrap address (an IPv6 host bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


class RoomClient:
    """Claims of encoder bootstrap rooms (see the module docstring). Use on one event loop; :meth:`close` at the
    end."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sockets: OrderedDict[str, tuple[zmq.asyncio.Socket, asyncio.Task]] = OrderedDict()
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}

    def _socket(self, ep: str) -> zmq.asyncio.Socket:
        entry = self._sockets.pop(ep, None)
        if entry is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(ep)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise StageError(f"bad encoder bootstrap address {ep!r}: {e}", 400) from None
            entry = (sock, asyncio.create_task(self._read(ep, sock)))
            if len(self._sockets) >= _MAX_SOCKETS:
                _, (old, reader) = self._sockets.popitem(last=False)
                reader.cancel()
                old.close(linger=0)
        self._sockets[ep] = entry
        return entry[0]

    async def _read(self, ep: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                reply = room_messages.decode(frames)
            except Exception as e:  # a peer that is not an encoder: drop its message, keep reading
                log.warning("dropped a malformed message from %s: %s", ep, str(e)[:300])
                continue
            fut = self._waiting.get((ep, reply.room)) if isinstance(reply, EmbedClaimReply) else None
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def claim(self, rid: str, room: EncodeRoom, image_hash: str, targets: list[str], share_host_id: str,
                    wait_s: float) -> EncodedImage:
        """Have the embedding of ``room`` pushed to ``targets`` as ``rid``'s image ``image_hash``; return what the
        encoder made of it.

        Raises:
            StageError: the encoder's status (404 no such room, 500 its encode failed, 503 a target took nothing,
                504 not encoded within ``wait_s``), or 504 when the encoder does not answer at all.
        """
        ep = endpoint(room.host, room.port)
        sock = self._socket(ep)
        key = (ep, room.room)
        if key in self._waiting:
            raise StageError(f"encoder room {room.room} is already being claimed", 400)
        fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        done = False
        try:
            await sock.send_multipart(room_messages.encode(EmbedClaim(room.room, rid, image_hash, targets,
                                                                      share_host_id, wait_s)))
            try:
                reply = await asyncio.wait_for(fut, wait_s + _REPLY_GRACE_S)
            except TimeoutError:
                raise StageError(f"the encoder at {ep} did not answer for room {room.room} within "
                                 f"{wait_s + _REPLY_GRACE_S:g} s", 504) from None
            done = True
        finally:
            self._waiting.pop(key, None)
            if not done:  # cancelled or unanswered: the encoder must not keep the room
                self._release(sock, room.room, rid, image_hash)
        if reply.status:
            raise StageError(f"image {room.span}: encoder room {room.room} at {ep}: {reply.error}", reply.status)
        return EncodedImage(image_hash, reply.num_tokens, list(reply.grid_thw))

    def _release(self, sock: zmq.asyncio.Socket, room: int, rid: str, image_hash: str) -> None:
        try:
            sock.send_multipart(room_messages.encode(EmbedClaim(room, rid, image_hash)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # nothing connected: the encoder's room timeout frees it
            pass

    async def claim_all(self, rid: str, rooms: list[EncodeRoom], hashes: list[str], targets: list[str],
                        share_host_id: str, wait_s: float) -> list[EncodedImage]:
        """:meth:`claim` every room (``hashes[i]`` is ``rooms[i]``'s image), concurrently; the first failure
        cancels (and so gives up) the others.

        Raises:
            StageError: that of the first claim to fail.
        """
        tasks = [asyncio.ensure_future(self.claim(rid, r, h, targets, share_host_id, wait_s))
                 for r, h in zip(rooms, hashes, strict=True)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Close every socket (claims in flight fail as cancelled)."""
        for sock, reader in self._sockets.values():
            reader.cancel()
            sock.close(linger=0)
        self._sockets.clear()
        self._ctx.term()
