"""Rank 0 of a TP prefill server: hand image embeddings to the scheduler only once every TP rank holds them.

The encoder pushes each request's embeddings to every rank's endpoint separately (``ServerInfo.embed_endpoints``),
so they arrive at different times, or (a rank's socket being down) not at all. A forward that uses an image needs its
rows on every rank, so rank 0 holds its own copy of an image's embedding here until each other rank has reported
the same (request id, image hash) (:class:`~epdserve.wire.messages.TPEmbedReceipt`); only then does the scheduler see
it. A request whose embeddings never reach some rank therefore waits in the scheduler, which fails it cleanly at
its deadline ("timed out waiting for image embeddings"), and no rank is ever asked for rows it lacks.

The gate also decides when the other ranks may drop their copies (:meth:`EmbeddingGate.releasable`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from epdserve.wire.messages import ImageEmbeddings
from epdserve.wire.tp_messages import TPEmbedReceipt

log = logging.getLogger(__name__)


class EmbeddingGate:
    """Embeddings per (rid, image hash) waiting for the other TP ranks' receipts.

    Args:
        num_ranks: the server's TP size; with 1 every embedding passes at once.
        timeout_s: an entry that stays incomplete this long is dropped (its request times out in the scheduler).
    """

    def __init__(self, num_ranks: int, timeout_s: float):
        self.num_ranks, self.timeout_s = num_ranks, timeout_s
        self._local: dict[str, dict[str, torch.Tensor]] = {}  # rid -> hash -> rank 0's embedding
        self._seen: dict[str, dict[str, set[int]]] = {}  # rid -> hash -> other ranks holding it
        self._deadline: dict[str, float] = {}  # rid -> when its incomplete entries are dropped
        self._at_ranks: set[str] = set()  # rids whose embeddings some other rank may still hold

    def add_local(self, msg: ImageEmbeddings) -> None:
        """Rank 0's own copy arrived."""
        for h in msg.image_hashes:
            log.debug("rid=%s TP rank 0 received the embedding of image %s", msg.rid, h[:12])
        self._touch(msg.rid)
        self._local.setdefault(msg.rid, {}).update(zip(msg.image_hashes, msg.embeddings))

    def add_receipt(self, receipt: TPEmbedReceipt) -> None:
        """Rank ``receipt.rank`` holds these embeddings."""
        self._touch(receipt.rid)
        self._at_ranks.add(receipt.rid)
        seen = self._seen.setdefault(receipt.rid, {})
        for h in receipt.image_hashes:
            seen.setdefault(h, set()).add(receipt.rank)

    def ready(self) -> list[ImageEmbeddings]:
        """The embeddings every rank holds now (one message per request), removed from the gate."""
        out = []
        for rid, by_hash in list(self._local.items()):
            seen = self._seen.get(rid, {})
            done = [h for h in by_hash if len(seen.get(h, ())) >= self.num_ranks - 1]
            if not done:
                continue
            out.append(ImageEmbeddings(rid=rid, image_hashes=done, embeddings=[by_hash.pop(h) for h in done]))
            for h in done:
                seen.pop(h, None)
            if not by_hash:
                del self._local[rid]
            if not seen:
                self._seen.pop(rid, None)
            if rid not in self._local and rid not in self._seen:
                self._deadline.pop(rid, None)
        return out

    def expire(self) -> list[str]:
        """Drop entries waiting past their deadline; returns their request ids."""
        now = time.monotonic()
        gone = [rid for rid, t in self._deadline.items() if t < now]
        for rid in gone:
            self.abort(rid)
        return gone

    def abort(self, rid: str) -> None:
        """Forget ``rid`` (its request was aborted)."""
        self._local.pop(rid, None)
        self._seen.pop(rid, None)
        self._deadline.pop(rid, None)

    def releasable(self, in_use: Iterable[str]) -> list[str]:
        """Request ids whose embeddings the other ranks may drop now: held by some rank, neither waiting here
        nor in ``in_use`` (the scheduler's embeddings). Each is returned once (until a rank reports it again)."""
        waiting = self._local.keys() | self._seen.keys()
        out = sorted(self._at_ranks - waiting - set(in_use))
        self._at_ranks.difference_update(out)
        return out

    def __len__(self) -> int:
        """Requests with embeddings waiting here."""
        return len(self._local.keys() | self._seen.keys())

    def _touch(self, rid: str) -> None:
        self._deadline.setdefault(rid, time.monotonic() + self.timeout_s)
