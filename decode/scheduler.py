"""Decode scheduling: register for a request's KV at the prefill bootstrap, load the KV into pages, and run
continuous batching (every running request advances one token per forward; requests join and leave between
forwards, as in Orca, Yu et al., OSDI 2022, and vLLM/SGLang).

Pages for the whole output (prompt + ``max_new_tokens``, capped at the context) are reserved at admission, so a
running request never runs out of KV space and no preemption is needed. A request of ``n`` choices is admitted
as ``n`` forks sharing its prompt's full pages (:mod:`epdserve.decode.forks`).

Overlap (SGLang's overlap scheduler, mini-sglang ``scheduler.py``): one decode step stays in flight on the GPU
while the host builds the next one and handles the previous one's tokens. Step N+1 takes its input ids straight
from step N's sampled ids on the device (no host round trip), so each step costs one device-to-host copy (the
new ids) whose wait overlaps the next step's GPU work. The price is that a request whose last token (EOS, stop
id) is only seen on the host after step N+1 was launched gets one wasted row in step N+1; its result is dropped.
Freeing such a request's pages at once is safe: all KV work runs on one CUDA stream, so whatever reuses them runs
after step N+1.

A batch with constrained rows cannot sample step N+1 before the host has step N's tokens (the grammar masks depend
on them), so there the host runs one forward ahead instead: N+1 is sampled once its masks are filled, and N+2's
forward is launched behind it at once, so the device runs a forward while the host reads tokens and fills masks
(a request that ends may then have two wasted rows).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from epdserve.decode.engine_pages import EnginePages, jump_reserved
from epdserve.decode.kv_checks import check_kv
from epdserve.decode.shared_kv import copy_shared_kv
from epdserve.decode.forks import ForkGroup, fork_copy_plan, fork_pages, make_forks
from epdserve.decode.steps import Forward, Step, decode_batch, output_ids
from epdserve.engine.grammar import Constraint, GrammarCompiler, GrammarMasker, accept_tokens, constraint_for
from epdserve.kvcache.engine import KVEngine
from epdserve.kvcache.page_pool import PagePool
from epdserve.kvcache.kv_share import PeerPools, host_id
from epdserve.kvcache.state_slots import StateSlots
from epdserve.wire.messages import DecodeRequest, KVAck, KVRegister, KVTransfer, Load, TokenLogprob, TokenOutput
from epdserve.metrics import DecodeMetrics
from epdserve.engine.model_runner import ModelRunner
from epdserve.engine.sampling import (apply_logit_bias, apply_penalties, choice_generator, has_penalties, sample,
                                      sampled_logprobs)

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    msg: DecodeRequest
    peer: bytes
    deadline: float
    transfer: KVTransfer | None = None
    pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    cached_tokens: int = 0  # prompt tokens whose KV the prefill server took from its radix cache
    mrope_delta: int = 0
    max_out: int = 0  # output tokens allowed: max_new_tokens, capped by the context length
    launched: int = 0  # output tokens sampled or being sampled on the device (>= len(output_ids))
    row: int = -1  # this request's row in the newest launched step
    done: bool = False  # finished or aborted: results still in flight for it are dropped
    arrival: float = 0.0  # time.monotonic() of the request's arrival, its KV's arrival, its admission (metrics)
    kv_at: float = 0.0
    admitted: float | None = None
    constraint: Constraint | None = None  # structured outputs: the request's grammar state
    index: int = 0  # n > 1: this fork's choice
    group: ForkGroup | None = None  # the prompt pages this fork shares with the request's other forks
    shared: int = 0  # how many of ``pages`` (the first) are the group's

    @property
    def key(self) -> tuple[int, int]:
        """This fork's state-slot key."""
        return self.msg.bootstrap_room, self.index


class DecodeScheduler:
    """Owns the decode server's page pool and running batch.

    Args:
        runner: the model runner.
        context_length: prompt + output tokens never exceed this.
        max_running_requests: largest decode batch.
        timeout_s: seconds a request waits for its KV.
        kv_endpoint: this server's KV receive endpoint, sent to prefill servers when registering.
        accept_shared: map the KV pools of prefill servers on this machine and copy KV pages out of them (the
            shared hand-off path, :mod:`epdserve.kvcache.kv_share`) instead of receiving the KV in the message.
        metrics: where to record (the server's; a fresh one by default).
        grammars: compiles constrained requests' grammars (None: such requests fail).
        engine: the transfer engine with this runner's pool registered (``--kv-transfer nixl|mooncake``): pages
            reserved at arrival for prefill to write into (:mod:`epdserve.decode.engine_pages`).
    """

    def __init__(self, runner: ModelRunner, *, context_length: int, max_running_requests: int,
                 timeout_s: float, kv_endpoint: str, accept_shared: bool = False,
                 metrics: DecodeMetrics | None = None, grammars: GrammarCompiler | None = None,
                 engine: KVEngine | None = None):
        self.runner, self.grammars = runner, grammars
        self.masker = GrammarMasker(runner.device)  # constrained rows' bitmasks: one host buffer for every step
        self.pool = PagePool(runner.num_pages, runner.page_size)
        self.states = StateSlots(runner)  # hybrid models: a state slot per running request (by bootstrap room)
        self.engine_pages = EnginePages(self.pool, engine, timeout_s, getattr(runner, "kv_regions", []), self.states)
        self.context_length = context_length
        self.max_running = max_running_requests
        self.timeout_s = timeout_s
        self.kv_endpoint = kv_endpoint
        self.eos_ids = set(runner.config.eos_token_ids)
        self.pending: dict[int, _Seq] = {}  # room -> request waiting for its KV
        self.ready: deque[_Seq] = deque()  # KV arrived, waiting for pages
        self.running: list[_Seq] = []
        self.inflight: Step | None = None  # the launched step whose sampled ids the host has not read yet
        self.ahead: Forward | None = None  # constrained batches: the next step's forward, launched, not sampled
        self.outputs: list[tuple[bytes, TokenOutput]] = []
        self.metrics = metrics if metrics is not None else DecodeMetrics()
        self.accept_shared, self.host_id, self.peer_pools = accept_shared, host_id(), PeerPools()
        # KV copied out of prefill pools, acknowledged once the copy ran: (done event or None, bootstrap, ack).
        self._acks: list[tuple[torch.cuda.Event | None, str, KVAck]] = []

    # ---- inputs -------------------------------------------------------------------------------------------
    def add_request(self, msg: DecodeRequest, peer: bytes) -> tuple[str, KVRegister]:
        """Track a request; returns ``(bootstrap endpoint, KVRegister)`` for the server to send."""
        now = time.monotonic()
        # The grammar compiles while prefill runs: by the time the KV arrives it is usually done.
        seq = self.pending[msg.bootstrap_room] = _Seq(msg, peer, deadline=now + self.timeout_s, arrival=now,
                                                      constraint=constraint_for(self.grammars, msg.sampling.grammar))
        regions, seq.pages, slot = self.engine_pages.reserve(msg, self.context_length, seq.key)  # []: KV in message
        log.debug("rid=%s request received", msg.rid)
        return msg.bootstrap_endpoint, KVRegister(rid=msg.rid, bootstrap_room=msg.bootstrap_room,
                                           kv_endpoint=self.kv_endpoint, host_id=self.host_id,
                                           accept_shared=self.accept_shared, regions=regions, kv_pages=list(seq.pages),
                                           state_slot=slot)

    def add_transfer(self, msg: KVTransfer) -> None:
        """KV (or an error) for a pending request; transfers for unknown rooms (aborted) are dropped."""
        seq = self.pending.pop(msg.bootstrap_room, None)
        if seq is None:
            log.debug("rid=%s KV for unknown room dropped", msg.rid)
            self.engine_pages.late_transfer(msg.bootstrap_room)  # an aborted request's engine write has ended
            return
        self.metrics.on_kv_received(msg)
        if msg.error is None:
            err = check_kv(self.runner.config, self.states, seq.msg, bool(seq.pages), msg)
            if err:
                self.metrics.on_kv_failure("bad_kv")
                msg = replace(msg, error=err)  # keeps ``pool``: pages lent for a rejected copy are acked too
        else:
            self.metrics.on_kv_failure("prefill_error")
        if msg.engine_written or (msg.error is not None and msg.pool is not None):  # the prefill server's pages
            self._ack(seq)  # held for it (lent, or written from): let them go
        if msg.error is not None:
            self._free(seq)  # pages reserved for an engine write
            self._emit(seq, "error", error=msg.error)
            return
        seq.transfer, seq.kv_at = msg, time.monotonic()
        self.ready.append(seq)
        log.debug("rid=%s KV received%s", msg.rid, f" (written by the engine: {msg.engine_bytes} bytes in "
                  f"{msg.engine_seconds * 1e3:.1f} ms)" if msg.engine_written else "")

    def abort(self, rid: str, index: int | None = None) -> None:
        """Drop ``rid`` wherever it is and free its pages; with ``index``, only choice ``index``'s running fork (its
        text ended at a stop string at the front), whose own pages go back now and the shared prompt pages with
        the request's last fork."""
        if index is not None:
            for seq in [s for s in self.running if s.msg.rid == rid and s.index == index]:
                self.running.remove(seq)
                self._free(seq)
            return
        for room in [room for room, s in self.pending.items() if s.msg.rid == rid]:
            self.engine_pages.hold_back(room, (seq := self.pending.pop(room)).pages, seq.key)  # a write may land
        for seq in [s for s in self.ready if s.msg.rid == rid]:
            self.ready.remove(seq)
            self._free(seq)
            if seq.transfer is not None and seq.transfer.pool is not None:  # the prefill server may free them now
                self._ack(seq)
        for seq in [s for s in self.running if s.msg.rid == rid]:
            self.running.remove(seq)
            self._free(seq)

    def fail_request(self, rid: str, error: str) -> None:
        """End a request still waiting for its KV with ``error`` (an output to its gateway) and drop it."""
        for room in [room for room, s in self.pending.items() if s.msg.rid == rid]:
            self._free(seq := self.pending.pop(room))
            self._emit(seq, "error", error=error)

    def load(self) -> Load:
        """What this scheduler holds now; with no request in flight every page is free and no room is held."""
        return Load(role="decode", num_running_reqs=len(self.running), num_waiting_reqs=len(self.ready),
                    kv_pages_used=self.pool.num_pages - self.pool.num_free, kv_pages_total=self.pool.num_pages,
                    rooms=len(self.pending), state_slots_used=self.states.used, state_slots_total=self.states.total)

    # ---- the loop body ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.ready) or self.inflight is not None or self.ahead is not None \
            or bool(self._acks)

    def take_acks(self) -> list[tuple[str, KVAck]]:
        """``(prefill bootstrap endpoint, KVAck)`` for every shared KV copy that has finished on the device."""
        done, pending = [], []
        for item in self._acks:
            (done if item[0] is None or item[0].query() else pending).append(item)
        self._acks = pending
        return [(endpoint, ack) for _, endpoint, ack in done]

    def step(self) -> list[tuple[bytes, TokenOutput]]:
        """Expire, admit, launch one decode step, then read the previous step's tokens; return the outputs to
        send as ``(gateway peer, output)``."""
        self._expire()
        self._admit()
        fwd, self.ahead = self.ahead or self._forward(self.inflight), None
        launched = None
        if fwd is not None:
            if fwd.constrained and self.inflight is not None:
                # A matcher must see step N's tokens before it can mask step N+1: read them now, while step N+1's
                # forward runs on the device, and fill the bitmask meanwhile (SGLang's overlap with grammars).
                self._collect(self.inflight)
                self.inflight = None
            launched = self._sample(fwd)
            if fwd.constrained:
                # Step N+2's forward goes on the device at once, behind N+1's sampling: it runs while the host
                # reads N+1's tokens and fills N+2's masks next turn, instead of after (the device would wait for
                # that host work every step). Requests admitted meanwhile join the forward after it.
                self.ahead = self._forward(launched)
        if self.inflight is not None:
            self._collect(self.inflight)
        self.inflight = launched
        out, self.outputs = self.outputs, []
        # Counted once per step, not per output: a prometheus inc per row was a tenth of a 128-row step's host work.
        self.metrics.on_tokens(sum(len(o.token_ids) for _, o in out))
        return out

    def fail_running(self, error: str) -> None:
        """After a failed forward: end every running request with ``error`` and free its pages."""
        self.metrics.on_error("forward_failed")
        for seq in self.running:
            log.debug("rid=%s failed: %s", seq.msg.rid, error)
            self._free(seq)
            self._emit(seq, "error", error=error)
        self.running = []
        self.inflight = self.ahead = None

    def fail_all(self, error: str) -> None:
        """Before the server stops: end every request (running, waiting for pages or for its KV) with ``error``;
        the outputs are in :attr:`outputs`."""
        self.fail_running(error)
        for seq in [*self.ready, *self.pending.values()]:
            self._free(seq)
            self._emit(seq, "error", error=error)
        self.ready.clear()
        self.pending.clear()

    # ---- internals ----------------------------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        self.engine_pages.tick()
        for room, seq in list(self.pending.items()):
            if seq.deadline < now:
                self.engine_pages.hold_back(room, self.pending.pop(room).pages, seq.key)  # a write may land
                log.warning("rid=%s timed out waiting for KV", seq.msg.rid)
                self.metrics.on_kv_failure("timeout")
                self._emit(seq, "error", error="timed out waiting for KV from the prefill server")

    def _admit(self) -> None:
        while self.ready and len(self.running) < self.max_running:
            seq = self.ready[0]
            n = seq.msg.sampling.n
            if (c := seq.constraint) is not None and c.matcher is None:
                if not c.ready():
                    break  # first come, first served: its grammar is still compiling
                if err := c.start():
                    self._free(self.ready.popleft())
                    self.metrics.on_error("bad_grammar")
                    self._emit(seq, "error", error=err)
                    continue
            total = min(seq.msg.prompt_len + seq.msg.sampling.max_new_tokens, self.context_length)
            shared, own = fork_pages(self.pool, seq.msg.prompt_len, total, n)
            need = shared + n * own
            if need > self.pool.num_pages or n > self.max_running:
                self._free(self.ready.popleft())
                self.metrics.on_error("kv_pool_too_small")
                self._emit(seq, "error", error=f"{n} x {total} tokens need more KV pages than the pool has, or "
                                               f"more running requests than --max-running-requests {self.max_running}")
                continue
            if need > self.pool.num_free + len(seq.pages) or len(self.running) + n > self.max_running \
                    or not self.states.acquire_all([(seq.msg.bootstrap_room, i) for i in range(n)]):
                if len(self.running) + n > self.max_running or not jump_reserved(self.ready):
                    break  # first come, first served ...
                continue  # ... but for a request that needs nothing it waits for
            self.ready.popleft()
            forks = make_forks(seq, shared, own, self.pool)
            transfer, seq.transfer = seq.transfer, None
            idx, slots = fork_copy_plan(self.pool, [f.pages for f in forks], seq.msg.prompt_len)
            if transfer.engine_written:  # into the pages (and state slot) reserved at arrival; acknowledged then
                p = seq.msg.prompt_len
                if len(slots) > p:  # n > 1: written into fork 0's pages, the partial page to the others
                    self.runner.write_kv(slots[p:], self.runner.read_kv(slots[:p].index_select(0, idx[p:])))
                self.states.copy_to(forks[0].key, [f.key for f in forks[1:]])
            elif transfer.pool is not None:
                err, done = copy_shared_kv(self.runner, self.peer_pools, forks, transfer, idx, slots,
                                           lambda: self._load_states(forks, transfer))
                self._ack(seq, done)
                if err:
                    self.metrics.on_kv_failure("shared_copy")
                    for f in forks:
                        self._free(f)
                    self._emit(seq, "error", error=err)
                    continue
            else:
                self.runner.write_kv(slots, transfer.kv if n == 1 else transfer.kv.index_select(2, idx))
                self._load_states(forks, transfer)
            firsts = transfer.first_token_ids or [transfer.first_token_id]
            lps = transfer.first_logprobs or [transfer.first_logprob]
            seq.admitted = time.monotonic()
            self.metrics.on_admit(seq.kv_at)
            for f in forks:
                f.cached_tokens, f.mrope_delta = transfer.cached_tokens, transfer.mrope_position_delta
                f.max_out, f.launched, f.admitted = total - seq.msg.prompt_len, 1, seq.admitted
                f.generator = choice_generator(seq.msg.sampling.seed, f.index, self.runner.device)
                self.running.append(f)
            log.debug("rid=%s admitted (%d choices, batch of %d)", seq.msg.rid, n, len(self.running))
            for f in forks:
                self._append_token(f, firsts[f.index], lps[f.index] if f.index < len(lps) else None)

    def _load_states(self, forks: list[_Seq], transfer: KVTransfer) -> None:
        """Load the handed-off state (hybrid models) into fork 0's slot and copy it into the other forks'."""
        self.states.load(forks[0].key, transfer.state, self.peer_pools)
        self.states.copy_to(forks[0].key, [f.key for f in forks[1:]])

    def _ack(self, seq: _Seq, done: torch.cuda.Event | None = None) -> None:
        """Queue the ``KVAck`` that lets the prefill server reuse the pages lent for ``seq``: at once, or once the
        device has passed ``done`` (the copy out of them)."""
        self._acks.append((done, seq.msg.bootstrap_endpoint,
                           KVAck(rid=seq.msg.rid, bootstrap_room=seq.msg.bootstrap_room)))

    def _forward(self, prev: Step | None) -> Forward | None:
        """Enqueue the forward of one decode step over the running requests that may still need a token (None
        when none does), taking the newest tokens of ``prev`` (the step before it) on the device; :meth:`_sample`
        samples it."""
        t0, seqs = time.perf_counter(), [s for s in self.running if s.launched < s.max_out]
        if not seqs:
            return None
        batch = decode_batch(seqs, prev, self.pool, self.states, self.runner.device)
        logits = self.runner.forward(batch)
        self.metrics.on_step(len(seqs))
        return Forward(seqs, batch.input_ids, logits, any(s.constraint is not None for s in seqs),
                       time.perf_counter() - t0)

    def _sample(self, fwd: Forward) -> Step:
        """Enqueue the sampling of ``fwd``'s logits (bias, penalties, a constrained row's grammar mask) and return
        the step, without waiting for the device. Constrained rows' matchers must have taken the tokens before."""
        t0, seqs, logits = time.perf_counter(), fwd.seqs, fwd.logits
        params = [s.msg.sampling for s in seqs]
        adjusted = apply_logit_bias(logits, params)
        if has_penalties(params):
            adjusted = apply_penalties(adjusted, output_ids(seqs, fwd.input_ids, self.runner.device), params)
        if fwd.constrained:
            t1 = time.perf_counter()
            adjusted = self.masker.mask(adjusted, [None if s.done else s.constraint for s in seqs])
            self.metrics.grammar_fill.observe(time.perf_counter() - t1)
        tokens = sample(adjusted, params, [s.generator for s in seqs])
        lp = sampled_logprobs(logits, tokens, params)  # now: a graph's logits are a view the next replay overwrites
        for row, seq in enumerate(seqs):
            seq.row, seq.launched = row, seq.launched + 1
        self.metrics.step_launch.observe(fwd.host_s + time.perf_counter() - t0)
        return Step(seqs, tokens, lp)

    def _collect(self, step: Step) -> None:
        """Wait for ``step``'s sampled ids and append them (finished or aborted requests' rows are dropped); the
        constrained rows' matchers take their tokens in one batched call first."""
        rows = [r for r in zip(step.seqs, step.host_tokens(), step.host_logprobs()) if not r[0].done]
        self.metrics.step_wait.observe(step.waited_s)
        grammar_rows = [k for k, (seq, _, _) in enumerate(rows) if seq.constraint is not None]
        t0 = time.perf_counter()
        accepted = dict(zip(grammar_rows, accept_tokens([rows[k][0].constraint for k in grammar_rows],
                                                        [rows[k][1] for k in grammar_rows])))
        if grammar_rows:
            self.metrics.grammar_accept.observe(time.perf_counter() - t0)
        for k, (seq, tok, tok_lp) in enumerate(rows):
            self._append_token(seq, tok, tok_lp, accepted.get(k))

    def _free(self, seq: _Seq) -> None:
        """Give back what an admitted request holds (its KV pages, its state slot): it has ended, one way or
        another, and is off the running list. Its outputs of a step still in flight are dropped."""
        if seq.done:
            return
        self.pool.free(seq.pages[seq.shared:])
        if seq.group is not None:
            self.pool.free(seq.group.release())  # the prompt's shared pages go with the last fork
        self.states.release(seq.key)
        seq.done = True

    def _append_token(self, seq: _Seq, tok: int, tok_lp: TokenLogprob | None = None,
                      accepted: bool | None = None) -> None:
        """Record ``seq``'s next token and finish it where that token ends it. A constrained ``seq``'s matcher
        takes the token here unless ``accepted`` says it already has (:func:`accept_tokens`) and with what result."""
        sp = seq.msg.sampling
        seq.output_ids.append(tok)
        finish, c = None, seq.constraint
        if c is not None and accepted is None:
            accepted = c.accept(tok)
        if c is not None and not accepted:  # only a first token sampled under another grammar
            self.running.remove(seq)
            self._free(seq)
            seq.pages = []
            self._emit(seq, "error", error=f"token {tok} is not allowed by the request's grammar")
            return
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids) or (c is not None and c.terminated):
            finish = "stop"
        elif len(seq.output_ids) >= seq.max_out:  # max_new_tokens, or the context is full
            finish = "length"
        if finish is not None:
            self.running.remove(seq)
            self._free(seq)
            seq.pages = []
        self._emit(seq, finish, token_ids=[tok], logprobs=[tok_lp] if tok_lp is not None else [])

    def _emit(self, seq: _Seq, finish: str | None, *, token_ids: list[int] = (), error=None,
              logprobs: list[TokenLogprob] = ()) -> None:
        if finish is not None:
            self.metrics.on_finish(finish, seq.arrival, seq.admitted, len(seq.output_ids))
        self.outputs.append((seq.peer, TokenOutput(
            rid=seq.msg.rid, token_ids=list(token_ids), finish_reason=finish,
            prompt_tokens=seq.msg.prompt_len, completion_tokens=len(seq.output_ids),
            cached_tokens=seq.cached_tokens, error=error, logprobs=list(logprobs), index=seq.index,
            last=seq.group is None or seq.group.live == 0)))

