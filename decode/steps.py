"""A decode step of :class:`~epdserve.decode.scheduler.DecodeScheduler`: its :class:`ForwardBatch`
(:func:`decode_batch`), the launched step (its rows and sampled ids on the device) and the output-id matrix its
penalties read."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from epdserve.device import to_device
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.engine.sampling import token_logprobs
from epdserve.wire.messages import TokenLogprob


@dataclass
class Forward:
    """A decode step's forward on the device, not sampled yet: its requests (row order), input ids ``[B]`` int64
    (on the device when taken from the step before), logits ``[B, V]`` (a CUDA graph's output buffer: sample
    before the next forward), whether any row is constrained, and the host seconds its launch took."""

    seqs: list
    input_ids: torch.Tensor
    logits: torch.Tensor
    constrained: bool
    host_s: float


class Step:
    """A launched decode step: its requests (row order) and sampled ids ``[B]`` int64 on the device, with their
    copy to pinned host memory already queued behind them; and, when a request asked, the rows' log-probabilities
    (:func:`epdserve.engine.sampling.sampled_logprobs`, on the device)."""

    def __init__(self, seqs: list, tokens: torch.Tensor,
                 logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        self.seqs, self.tokens, self.logprobs = seqs, tokens, logprobs
        self._host, self._ready, self.waited_s = tokens, None, 0.0
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def host_tokens(self) -> list[int]:
        """The sampled ids as a list, waiting for the device if it is not done yet (``waited_s``: how long, in
        seconds)."""
        if self._ready is not None:
            t0 = time.perf_counter()
            self._ready.synchronize()
            self.waited_s = time.perf_counter() - t0
        return self._host.tolist()

    def host_logprobs(self) -> list[TokenLogprob | None]:
        """Per row, the sampled token's :class:`TokenLogprob` (None for rows that did not ask). Call after
        :meth:`host_tokens`: the values are then computed, and copying them is all that is left."""
        return token_logprobs(self.logprobs, [s.msg.sampling for s in self.seqs])


def output_ids(seqs: list, newest: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``[B, L]`` int64 on ``dev``: each request's output ids so far, padded with -1. The newest one of each row
    is ``newest`` (this step's input ids, maybe still on the device from the previous step); the ones before it
    are on the host."""
    before = [s.output_ids[:s.launched - 1] for s in seqs]
    width = max(map(len, before))
    host = torch.tensor([ids + [-1] * (width - len(ids)) for ids in before], dtype=torch.int64).view(len(seqs), width)
    newest = newest if newest.device.type == dev.type else to_device(newest, dev)
    return torch.cat([to_device(host, dev), newest[:, None]], dim=1)


def decode_batch(seqs: list, prev: Step | None, pool, states, dev: torch.device) -> ForwardBatch:
    """The decode step's batch over running requests ``seqs``: one new token each, at sequence index
    ``prompt_len + launched - 1``. A request whose newest token is still on the device (sampled by ``prev``, the
    step in flight) takes it from there without a host round trip; the rest is built on the CPU, for the model
    runner to move over in one asynchronous copy. ``pool``: the :class:`~epdserve.kvcache.page_pool.PagePool`;
    ``states``: the scheduler's :class:`~epdserve.kvcache.state_slots.StateSlots`.

    In the steady state (the same requests as ``prev``, in its row order) the input ids are ``prev``'s sampled
    ids as they are: no host-to-device copy and no kernel. That and building the positions as one list are host
    time a decode step spends whatever its batch: on two H200s a TP-2 decode step at one request was host-bound,
    and the gather of the ids took 12 % of its scheduler's time (docs/performance.md, fifteenth session)."""
    idx = [s.msg.prompt_len + s.launched - 1 for s in seqs]  # sequence index of each input token
    page = pool.page_size  # each input token's KV slot: page * page_size + offset (PagePool.slots, inlined)
    rows = [s.row if s.launched > len(s.output_ids) else -1 for s in seqs]
    pos = [i + s.mrope_delta for s, i in zip(seqs, idx)]  # decode_positions: the same index on all three axes
    return ForwardBatch(
        is_decode=True,
        input_ids=_input_ids(seqs, rows, prev, dev),
        positions=torch.tensor([pos, pos, pos], dtype=torch.int64),
        out_slots=torch.tensor([s.pages[i // page] * page + i % page for s, i in zip(seqs, idx)], dtype=torch.int64),
        q_lens=[1] * len(seqs),
        kv_lens=[i + 1 for i in idx],
        page_table=[s.pages for s in seqs],
        state_slots=states.slots([s.key for s in seqs]),
    )


def _input_ids(seqs: list, rows: list[int], prev: Step | None, dev: torch.device) -> torch.Tensor:
    """``[B]`` int64: row b's newest token, from ``prev.tokens[rows[b]]`` where ``rows[b] >= 0`` (sampled by the
    step in flight), else from the host."""
    if prev is None or max(rows, default=-1) < 0:
        return torch.tensor([s.output_ids[-1] for s in seqs], dtype=torch.int64)
    if min(rows) >= 0:
        if rows == list(range(len(rows))):
            return prev.tokens[:len(rows)]
        return prev.tokens[to_device(torch.tensor(rows, dtype=torch.int64), dev)]
    host = torch.tensor([s.output_ids[-1] if r < 0 else 0 for s, r in zip(seqs, rows)], dtype=torch.int64)
    rows_t = to_device(torch.tensor(rows, dtype=torch.int64), dev)
    return torch.where(rows_t >= 0, prev.tokens[rows_t.clamp(min=0)], to_device(host, dev))
