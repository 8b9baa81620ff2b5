"""What the prefill scheduler holds per request (:class:`PrefillRecord`, one table of them in
:class:`~epdserve.prefill.scheduler.PrefillScheduler`) and the forward batch it builds from them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.engine.grammar import Constraint
from epdserve.hashing import image_pad_id  # noqa: F401  (the scheduler's name for it)
from epdserve.kvcache.page_pool import PagePool
from epdserve.wire.messages import KVRegister, KVTransfer, PrefillRequest, TokenLogprob


class RecordState(enum.Enum):
    """Where a record is; what its ``deadline`` means there."""
    EARLY = "early"  # keyed by rid: embeddings before their request, and/or an aborted id's marker (drop at deadline)
    REGISTERED = "registered"  # a decode registration before its request (dropped at the deadline)
    WAITING = "waiting"  # a request waiting for embeddings or pages (fails at the deadline)
    RUNNING = "running"  # holds pages, partly prefilled (no deadline: it ends, fails or is aborted)
    FINISHED = "finished"  # KV or an error ready, waiting for a registration (pages back at the deadline)
    LENT = "lent"  # a decode server copies its pages (shared path), or an engine writes them into decode's (engine
    # path: ``write`` set until it completes); pages back at decode's KVAck or the deadline


@dataclass
class PrefillRecord:
    """Everything prefill holds for one request: its table key is the bootstrap ``room`` once a request or a
    registration names it, else the ``rid`` (embeddings that came first, an aborted id's marker)."""
    rid: str
    room: int | None
    state: RecordState
    deadline: float  # time.monotonic() when the sweep acts (see RecordState)
    msg: PrefillRequest | None = None
    reg: KVRegister | None = None  # the decode server's registration for the room
    embeds: dict[str, torch.Tensor] | None = None  # image hash -> [n, embed_width]; None: none received
    transfer: KVTransfer | None = None  # FINISHED: host-path or error transfer (None: the KV is in ``pages``)
    aborted_until: float = 0.0  # EARLY: this id was aborted; its late inputs are kept _LATE_S only
    arrival: float = 0.0  # time.monotonic() when the request arrived (queue time, time in prefill)
    positions: torch.Tensor | None = None  # [3, n] int64
    mrope_delta: int = 0
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    node: object = None  # locked radix node of the matched prefix
    cached: int = 0  # tokens whose KV came from the radix cache
    computed: int = 0  # tokens with KV in this server's pages
    first_tokens: list[int] = field(default_factory=list)  # one per choice, sampled once the prompt is prefilled
    first_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # theirs, when the request asked
    constraint: Constraint | None = None  # structured outputs: the grammar of the first token, until it is sampled
    write: object = None  # LENT, engine path: the EngineWrite (prefill/transfers.py) still in flight

    @property
    def first_token(self) -> int:
        """Choice 0's first token (-1 before it is sampled)."""
        return self.first_tokens[0] if self.first_tokens else -1

    def choice_fields(self) -> dict:
        """The first-token fields of this prefilled request's ``KVTransfer``: choice 0's, and every choice's when
        it has more than one."""
        lps = self.first_logprobs
        many = len(self.first_tokens) > 1
        return dict(first_token_id=self.first_token, first_logprob=lps[0] if lps else None,
                    first_token_ids=list(self.first_tokens) if many else [],
                    first_logprobs=[lp for lp in lps if lp is not None] if many else [])

    @property
    def n(self) -> int:
        """Prompt length in tokens."""
        return len(self.msg.input_ids)


def prefill_batch(reqs: list[PrefillRecord], chunks: list[tuple[int, int]], pool: PagePool) -> ForwardBatch:
    """The forward batch computing tokens ``[s, e)`` of each request's prompt (``chunks``, one per request of
    ``reqs``), its image and video tokens taken from the request's embeddings (a span's token ``offset + i`` is row
    ``embed_offset + i`` of its item's embedding). Built on the host: the runner moves what it
    needs (a CUDA graph takes it in one pinned copy).

    Raises:
        KeyError: an image's embedding is missing (the scheduler admits a request only with all of them).
    """
    ids, pos, slots, mask, mm, sources = [], [], [], [], [], []
    for req, (s, e) in zip(reqs, chunks):
        ids.extend(req.msg.input_ids[s:e])
        pos.append(req.positions[:, s:e])
        slots.extend(pool.slots(req.pages, s, e))
        m = torch.zeros(e - s, dtype=torch.bool)
        got = req.embeds or {}
        for span in req.msg.images:
            a, b = max(s, span.offset), min(e, span.offset + span.length)
            if a < b:
                m[a - s:b - s] = True
                # Rows of the whole image's or video's embedding: a video span starts at its embed_offset. TP
                # followers slice their own copy by these same absolute rows.
                lo, hi = span.embed_offset + a - span.offset, span.embed_offset + b - span.offset
                mm.append(got[span.image_hash][lo:hi])
                sources.append((req.msg.rid, span.image_hash, lo, hi))
        mask.append(m)
    return ForwardBatch(
        is_decode=False,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.cat(pos, dim=1),
        out_slots=torch.tensor(slots, dtype=torch.int64),
        q_lens=[e - s for s, e in chunks],
        kv_lens=[e for _, e in chunks],
        page_table=[r.pages for r in reqs],
        # One piece (one image or video in the chunk) goes as a view: a Qwen3-VL video's rows are tens of MB.
        mm_embeds=(mm[0] if len(mm) == 1 else torch.cat(mm)) if mm else None,
        mm_mask=torch.cat(mask) if mm else None,
        mm_sources=sources if mm else None,
    )


def plan_forward(running: list[PrefillRecord], budget: int, chunk: int, states, graphs
                 ) -> tuple[list[PrefillRecord], list[tuple[int, int]], list]:
    """What the next prefill forward computes: the ``running`` requests in admission order while ``budget`` new
    tokens last, each its next chunk ``[start, end)`` of at most ``chunk`` tokens, and the state snapshots taken on
    the way (``states``: :class:`~epdserve.kvcache.state_slots.StateSlots`; :meth:`reserve_cuts`' list, empty for
    other models). A lone request that ``graphs`` (the runner's ``PrefillGraphRunner`` or None) would replay is
    cut at its snapshot point instead: graphs take no snapshot, so it gets two forwards.

    Returns:
        ``(requests, chunks, cuts)``.
    """
    reqs, chunks = [], []
    for req in running:
        if budget <= 0:
            break
        take = min(req.n - req.computed, budget, chunk)
        reqs.append(req)
        chunks.append((req.computed, req.computed + take))
        budget -= take
    if len(reqs) == 1 and graphs is not None and chunks[0][1] - chunks[0][0] <= graphs.max_tokens:
        start, end = chunks[0]
        chunks[0] = (start, start + states.cut_chunk(start, end - start, reqs[0].n))
        return reqs, chunks, []
    return reqs, chunks, states.reserve_cuts([(r.key, s, e, r.n) for r, (s, e) in zip(reqs, chunks)])
