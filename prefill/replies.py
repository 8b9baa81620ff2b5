"""Answers to the prefill HTTP front: one ``TokenOutput`` per ``PrefillRequest`` that asked for it (``reply``).

The epdserve gateway never asks (it hears everything from decode), so its sockets never see these. The HTTP front
asks, because a PD router such as smg waits for the prefill leg's HTTP status: it must learn when prefill is done
(or failed) without decoding anything.

A request is done when the scheduler has its KV and first token (it sits in ``PrefillScheduler.finished`` until a
decode server registers for its room) or when that KV was handed over in this step. Done means the prefill work
is over, not that decode has the KV: the router's decode leg may still be on its way, and the room then waits for
it up to the scheduler's deadline. Not waiting for the hand-over keeps the prefill leg's answer independent of the
decode leg, so a router that joins both legs never waits on a decode server that is gone.
"""

from __future__ import annotations

import time
from typing import Any

from epdserve.wire.messages import KVTransfer, PrefillRequest, TokenOutput


class PrefillReplies:
    """Tracks the requests whose sender wants a reply and builds the replies once they are done.

    Args:
        timeout_s: a tracked request never seen done within this many seconds (aborted, expired in the scheduler)
            is forgotten; its sender has its own deadline.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._by_room: dict[int, tuple[bytes, str, int, float]] = {}  # room -> (peer, rid, prompt_len, deadline)

    def __len__(self) -> int:
        return len(self._by_room)

    def track(self, peer: bytes, msg: PrefillRequest) -> None:
        """Remember ``msg``'s sender if it asked for a reply (``msg.reply``)."""
        if msg.reply:
            self._by_room[msg.bootstrap_room] = (peer, msg.rid, len(msg.input_ids),
                                                 time.monotonic() + self.timeout_s)

    def forget(self, rid: str) -> None:
        """Drop ``rid`` (aborted by its sender)."""
        for room in [room for room, v in self._by_room.items() if v[1] == rid]:
            del self._by_room[room]

    def collect(self, finished: dict[int, tuple[float, Any]],
                sent: list[KVTransfer]) -> list[tuple[bytes, TokenOutput]]:
        """The replies due now, as ``(peer, TokenOutput)``.

        Args:
            finished: the scheduler's ``finished`` table (room -> (deadline, transfer, or the prefilled request
                whose pages wait for a shared hand-off)): done, waiting for decode.
            sent: the transfers the scheduler handed over in this step (no longer in ``finished``).

        The reply carries the first token (``finish_reason="length"``: prefill's part ends there) or the error
        (``finish_reason="error"``), with the prompt and cached token counts.
        """
        if not self._by_room:
            return []
        out = []
        done = {t.bootstrap_room: t for t in sent}
        for room in list(self._by_room):
            transfer = done.get(room)
            if transfer is None and room in finished:
                transfer = finished[room][1]
            if transfer is None:
                continue
            peer, rid, prompt_len, _ = self._by_room.pop(room)
            error, first, cached = _outcome(transfer)
            out.append((peer, TokenOutput(
                rid=rid, token_ids=[] if error else [first], finish_reason="error" if error else "length",
                prompt_tokens=prompt_len, completion_tokens=0 if error else 1, cached_tokens=cached, error=error)))
        now = time.monotonic()
        for room in [room for room, v in self._by_room.items() if v[3] < now]:
            del self._by_room[room]
        return out


def _outcome(item: Any) -> tuple[str | None, int, int]:
    """``(error, first token, cached tokens)`` of a ``finished`` entry: a ``KVTransfer`` (host path or error) or a
    prefilled request kept for a shared hand-off (``first_token``, ``cached``)."""
    if isinstance(item, KVTransfer):
        return item.error, item.first_token_id, item.cached_tokens
    return None, item.first_token, item.cached
