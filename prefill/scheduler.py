"""Prefill scheduling: wait for a request's image embeddings, reuse cached prefix KV from the radix cache,
run chunked prefill over KV pages, sample the first token, and hand the KV to the decode server that
registered for the request's bootstrap room.

Three hand-off paths (``--kv-transfer``): through host memory (the KV is gathered into a host tensor that travels
over ZeroMQ, and the pages are freed at once), shared (a decode server on this machine maps this server's
KV pool and copies the pages device to device; they stay held until its ``KVAck``), or a transfer engine (NIXL,
Mooncake: this server writes the pages into those the decode server registered, then tells it; they stay held
until its ``KVAck``).

Requests and embeddings arrive in either order (the encoder pushes embeddings while the gateway sends the
request). Decode registrations can come before or after prefill ends. Everything a request holds lives in one
record (:class:`_Req`) in one table, and one sweep (:meth:`PrefillScheduler._sweep`) enforces every deadline.
"""

from __future__ import annotations

import logging
import time
import torch

from epdserve.kvcache.page_pool import PagePool
from epdserve.kvcache.radix_cache import RadixCache
from epdserve.kvcache.kv_share import host_id
from epdserve.kvcache.state_slots import StateSlots
from epdserve.wire.messages import ImageEmbeddings, KVAck, KVRegister, KVTransfer, Load, PrefillRequest
from epdserve.metrics import PrefillMetrics
from epdserve.engine.model_runner import ModelRunner
from epdserve.models.mrope import mrope_positions
from epdserve.engine.grammar import GrammarCompiler, constraint_for
from epdserve.prefill.checks import check_embeds, validate_request
from epdserve.prefill.first_token import sample_first_tokens
from epdserve.prefill.records import (PrefillRecord as _Req, RecordState as _State, image_pad_id, plan_forward,
                                      prefill_batch)
from epdserve.prefill.transfers import EngineWriter, engine_transfer, host_transfer, shared_transfer
from epdserve.kvcache.engine import KVEngine, KVEngineError

log = logging.getLogger(__name__)


_LATE_S = 2.0  # seconds an aborted request's late embeddings or registration are kept


class PrefillScheduler:
    """Owns the prefill server's page pool and radix cache; one instance per TP rank's scheduler loop.

    Args:
        runner: the model runner (its KV pool has ``runner.num_pages`` pages of ``runner.page_size`` tokens).
        context_length: longest prompt accepted, in tokens (a prompt must leave room for one output token).
        max_prefill_tokens: new tokens computed per forward, summed over the batch.
        chunked_prefill_size: new tokens of one request per forward (chunked prefill, as in Sarathi, Agrawal et
            al., OSDI 2024, and SGLang's ``--chunked-prefill-size``); 0 = no bound but ``max_prefill_tokens``.
        timeout_s: seconds a request waits for embeddings, or its KV waits for a decode registration.
        metrics: where to record (the server's; a fresh one by default).
        state_snapshot_slots: hybrid models: DeltaNet state snapshots for radix hits (:class:`StateSlots`).
        grammars: compiles constrained requests' grammars (None: such requests fail).
        engine: the transfer engine with this runner's pool registered (``--kv-transfer nixl|mooncake``), or None.
    """

    def __init__(self, runner: ModelRunner, *, context_length: int, max_prefill_tokens: int, timeout_s: float,
                 chunked_prefill_size: int = 0, metrics: PrefillMetrics | None = None, state_snapshot_slots: int = 0,
                 grammars: GrammarCompiler | None = None, engine: KVEngine | None = None):
        self.runner, self.grammars, self.engine = runner, grammars, engine
        self.writer = EngineWriter(engine, runner) if engine is not None else None  # writes on every TP rank
        self.cfg = runner.config
        self.pool = PagePool(runner.num_pages, runner.page_size)
        self.radix = RadixCache(runner.page_size)
        self.context_length = context_length
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk = chunked_prefill_size if chunked_prefill_size > 0 else max_prefill_tokens
        self.timeout_s = timeout_s
        # room (or rid, for EARLY records) -> record. Insertion order is the queue order: a record moves to the end
        # when its request arrives, is admitted and finishes, so WAITING records are in arrival order (first come,
        # first served), RUNNING ones in admission order and FINISHED ones in finishing order.
        self.reqs: dict[int | str, _Req] = {}
        self.pool_handle = runner.kv_handle()  # None: this pool is not shared, KV goes through host memory
        self.states = StateSlots(runner, state_snapshot_slots)  # hybrid models: a state slot per request
        self.host_id = host_id()
        self.metrics = metrics if metrics is not None else PrefillMetrics()

    # ---- views (read-only; for the server loop, its replies and tests) ---------------------------------------
    def _in(self, *states: _State) -> list[_Req]:
        return [r for r in self.reqs.values() if r.state in states]

    @property
    def running(self) -> list[_Req]:
        """Requests holding pages and partly prefilled, in admission order."""
        return self._in(_State.RUNNING)

    @property
    def embeds(self) -> dict[str, dict[str, torch.Tensor]]:
        """rid -> image hash -> embedding [n, hidden], for every request id whose embeddings are held."""
        return {r.rid: r.embeds for r in self.reqs.values() if r.embeds is not None}

    @property
    def finished(self) -> dict[int, tuple[float, KVTransfer | _Req]]:
        """room -> (deadline, the transfer, or the prefilled request whose pages hold its KV): done, waiting for
        a decode registration (the shape :meth:`PrefillReplies.collect` reads)."""
        return {r.room: (r.deadline, r.transfer if r.transfer is not None else r) for r in self._in(_State.FINISHED)}

    # ---- inputs -------------------------------------------------------------------------------------------
    def add_request(self, msg: PrefillRequest) -> None:
        """Queue a prompt; invalid prompts become an error transfer for the decode server."""
        now = time.monotonic()
        err = validate_request(msg, self.cfg, self.context_length)
        if err:
            log.warning("rid=%s rejected: %s", msg.rid, err)
            self.metrics.on_error("invalid_request")
            early = self.reqs.get(msg.rid)
            if early is not None:  # its embeddings go; an aborted id's marker stays
                self._drop_early_embeds(early, now)
            self._finish_error(self._room_record(msg, now), err)
            return
        early = self.reqs.pop(msg.rid, None)  # embeddings that came first; a new request under a reused id
        rec = self._room_record(msg, now)
        rec.state, rec.deadline, rec.arrival = _State.WAITING, now + self.timeout_s, now
        rec.embeds = early.embeds if early is not None else None
        rec.constraint = constraint_for(self.grammars, msg.sampling.grammar)  # compiles while embeddings come
        self._to_end(rec)
        log.debug("rid=%s request received (%d tokens)", msg.rid, len(msg.input_ids))

    def add_embeddings(self, msg: ImageEmbeddings) -> None:
        """Stash the encoder's embeddings for ``msg.rid`` until (or after) its request arrives (kept only briefly
        when that id was just aborted)."""
        now = time.monotonic()
        # A scan, not an index: records are bounded by the requests in flight, and one table stays consistent.
        rec = next((r for r in self.reqs.values()
                    if r.rid == msg.rid and r.state in (_State.WAITING, _State.RUNNING)), None)
        if rec is None:
            rec = self.reqs.get(msg.rid)
            if rec is None:
                rec = self.reqs[msg.rid] = _Req(msg.rid, None, _State.EARLY, now + self.timeout_s)
            if rec.embeds is None:  # the first arrival sets the deadline, as later ones only add images
                rec.deadline = now + (_LATE_S if rec.aborted_until > now else self.timeout_s)
                rec.embeds = {}
        elif rec.embeds is None:
            rec.embeds = {}
        log.debug("rid=%s embeddings received", msg.rid)
        for h, emb in zip(msg.image_hashes, msg.embeddings):
            rec.embeds[h] = emb

    def register(self, msg: KVRegister) -> None:
        """A decode server asks for the KV of ``msg.bootstrap_room`` at ``msg.kv_endpoint`` (kept only briefly
        when that id was just aborted)."""
        now = time.monotonic()
        early = self.reqs.get(msg.rid)
        late = early is not None and early.aborted_until > now
        rec = self.reqs.get(msg.bootstrap_room)
        if rec is None:
            rec = self.reqs[msg.bootstrap_room] = _Req(msg.rid, msg.bootstrap_room, _State.REGISTERED, 0.0)
        if rec.state is _State.REGISTERED:  # with a request, the registration lives as long as the request
            rec.deadline = now + (_LATE_S if late else self.timeout_s)
        rec.reg = msg

    def ack(self, msg: KVAck) -> None:
        """A decode server copied the KV of ``msg.bootstrap_room`` out of this pool: its pages may be reused."""
        rec = self.reqs.get(msg.bootstrap_room)
        if rec is not None and rec.state is _State.LENT:
            del self.reqs[msg.bootstrap_room]
            self._release(rec, insert=True)
            log.debug("rid=%s KV copied by decode, pages released", msg.rid)

    def abort(self, rid: str) -> None:
        """Drop ``rid`` wherever it is and free its pages; its embeddings or registration arriving later are
        kept only briefly (a client may reuse its id at once, and that new request's inputs must not be lost)."""
        now = time.monotonic()
        for key, rec in list(self.reqs.items()):
            # A registration whose request never came stays until its own deadline, as it always did.
            if rec.rid == rid and rec.state not in (_State.EARLY, _State.REGISTERED):
                del self.reqs[key]
                if rec.pages:  # KV never sent: not worth a radix entry (as before the records)
                    self._release(rec, insert=False)
        # Embeddings and registrations travel on other sockets than the abort and may land after it: the marker
        # keeps them _LATE_S only instead of their full timeout.
        self.reqs[rid] = _Req(rid, None, _State.EARLY, now + self.timeout_s, aborted_until=now + self.timeout_s)

    def load(self) -> Load:
        """What this scheduler holds now; with no request in flight, ``kv_pages_used == kv_pages_cached``."""
        used = self.pool.num_pages - self.pool.num_free
        recs = list(self.reqs.values())
        rooms = sum(1 for r in recs if r.room is not None and (r.reg is not None or r.state in (_State.FINISHED,
                                                                                                 _State.LENT)))
        return Load(role="prefill", num_running_reqs=sum(r.state is _State.RUNNING for r in recs),
                    num_waiting_reqs=sum(r.state is _State.WAITING for r in recs),
                    kv_pages_used=used, kv_pages_total=self.pool.num_pages, kv_pages_cached=self.radix.num_pages,
                    rooms=rooms, embeddings=len(self.embeds), **self.states.load_fields())

    # ---- the loop body ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """True when :meth:`step` would run a forward now."""
        return any(r.state is _State.RUNNING or (r.state is _State.WAITING and self._inputs_ready(r))
                   or r.write is not None for r in self.reqs.values())  # an engine write: poll it

    def step(self) -> list[tuple[str, KVTransfer]]:
        """Admit ready requests, run one prefill forward, and return the transfers to send now as
        ``(decode KV endpoint, KVTransfer)``."""
        self._sweep()
        self._admit()
        if self.running:
            self._forward()
        out = []
        for rec in [r for r in self._in(_State.FINISHED) if r.reg is not None]:
            del self.reqs[rec.room]
            transfer = rec.transfer if rec.transfer is not None else self._hand_off(rec)
            if transfer is not None:  # None: an engine write started, its transfer goes once it is done
                self.metrics.on_kv_sent(transfer)
                out.append((rec.reg.kv_endpoint, transfer))
        return out + self._poll_writes()

    def _poll_writes(self) -> list[tuple[str, KVTransfer]]:
        """Transfers of engine writes that finished (pages LENT until decode's ack) or failed (pages back)."""
        out = []
        for rec in [r for r in self._in(_State.LENT) if r.write is not None]:
            try:
                if not self.writer.poll(rec.write):
                    continue
                transfer, rec.write = engine_transfer(rec, rec.write), None
            except KVEngineError as e:
                log.warning("rid=%s KV write to the decode server failed: %s", rec.rid, e)
                self.metrics.on_kv_failure("engine_write")
                del self.reqs[rec.room]
                rec.write = None
                self._release(rec, insert=True)
                transfer = KVTransfer(rid=rec.msg.rid, bootstrap_room=rec.room, error=f"KV transfer failed: {e}")
            self.metrics.on_kv_sent(transfer)
            out.append((rec.reg.kv_endpoint, transfer))
        return out

    def fail_running(self, error: str) -> None:
        """After a failed forward: end every running request with ``error`` and free its pages."""
        for rec in self.running:
            self._release(rec, insert=False)
            self.metrics.on_error("forward_failed")
            self._finish_error(rec, error)

    def fail_all(self, error: str) -> None:
        """Before the server stops: end every running and waiting request with ``error`` (the error transfers go
        out on the next :meth:`step` to the decode servers registered for them)."""
        self.fail_running(error)
        for rec in self._in(_State.WAITING):
            self._finish_error(rec, error)

    # ---- the table ----------------------------------------------------------------------------------------
    def _room_record(self, msg: PrefillRequest, now: float) -> _Req:
        """The record of ``msg``'s room (kept if only a registration was there), holding ``msg``."""
        rec = self.reqs.get(msg.bootstrap_room)
        if rec is not None and rec.state is not _State.REGISTERED:
            # Rooms are random 63-bit ids, so this is a resent request: the old one goes, its pages with it.
            del self.reqs[msg.bootstrap_room]
            if rec.pages:
                self._release(rec, insert=False)
            rec = _Req(msg.rid, msg.bootstrap_room, _State.REGISTERED, now, reg=rec.reg)
        elif rec is None:
            rec = _Req(msg.rid, msg.bootstrap_room, _State.REGISTERED, now)
        rec.rid, rec.msg = msg.rid, msg
        self.reqs[msg.bootstrap_room] = rec
        return rec

    def _to_end(self, rec: _Req) -> None:
        """Move ``rec`` to the end of the table (the queue order, see ``__init__``)."""
        key = rec.room if rec.room is not None else rec.rid
        self.reqs[key] = self.reqs.pop(key)

    def _drop_early_embeds(self, rec: _Req, now: float) -> None:
        """An EARLY record's embeddings go; the record stays while it marks an aborted id."""
        rec.embeds = None
        if rec.aborted_until > now:
            rec.deadline = rec.aborted_until
        else:
            del self.reqs[rec.rid]

    def _finish_error(self, rec: _Req, error: str) -> None:
        """End ``rec``'s request with ``error`` (its pages must already be released): an error transfer waits for
        its decode registration."""
        log.debug("rid=%s failed: %s", rec.rid, error)
        rec.embeds, rec.constraint = None, None
        rec.transfer = KVTransfer(rid=rec.msg.rid, bootstrap_room=rec.msg.bootstrap_room, error=error)
        rec.state, rec.deadline = _State.FINISHED, time.monotonic() + self.timeout_s
        self._to_end(rec)

    def _sweep(self) -> None:
        """The one deadline check: every record past its deadline moves on as its state says."""
        now = time.monotonic()
        for rec in [r for r in self.reqs.values() if r.deadline < now and r.state is not _State.RUNNING]:
            if rec.state is _State.WAITING:
                log.warning("rid=%s timed out waiting for image embeddings", rec.rid)
                self.metrics.on_error("embeddings_timeout")
                self._finish_error(rec, "timed out waiting for image embeddings")
            elif rec.state is _State.EARLY:  # embeddings whose request never came, an aborted id's marker
                self._drop_early_embeds(rec, now)
            else:  # a registration whose request never came, KV nobody asked for or never acknowledged
                del self.reqs[rec.room]
                if rec.state is _State.FINISHED:
                    self.metrics.on_kv_failure("no_registration")
                elif rec.state is _State.LENT:  # its decode server died before copying the KV
                    self.metrics.on_kv_failure("no_ack")
                if rec.pages:
                    log.warning("rid=%s KV not taken by a decode server in time; pages released", rec.rid)
                    self._release(rec, insert=True)

    # ---- internals ----------------------------------------------------------------------------------------
    def _inputs_ready(self, req: _Req) -> bool:
        """Every embedding is here and the grammar, if any, has compiled (or failed to)."""
        if req.constraint is not None and not req.constraint.ready():
            return False
        got = req.embeds or {}
        return all(s.image_hash in got for s in req.msg.images)

    def _admit(self) -> None:
        for req in self._in(_State.WAITING):
            rid = req.rid
            if not self._inputs_ready(req):
                continue
            err = check_embeds(req, self.cfg)
            if err:
                self.metrics.on_error("bad_embeddings")
                self._finish_error(req, err)
                continue
            if req.constraint is not None and req.constraint.matcher is None and (err := req.constraint.start()):
                self.metrics.on_error("bad_grammar")
                self._finish_error(req, err)
                continue
            if not self._allocate(req):
                # Pages held now come back (prefill ends, a decode server acks or dies, deadlines): only a prompt
                # larger than the whole pool can never fit. Failing whenever nothing runs here would fail requests
                # under load while decode servers still copy lent pages.
                if self.pool.pages_for(req.n) > self.pool.num_pages:
                    self.metrics.on_error("kv_pool_too_small")
                    self._finish_error(req, f"prompt of {req.n} tokens needs more KV pages than the pool has")
                    continue
                break  # first come, first served: later requests wait behind it
            req.state = _State.RUNNING
            self._to_end(req)
            self.metrics.on_admit(req.arrival)
            log.debug("rid=%s admitted (%d of %d tokens cached)", rid, req.cached, req.n)

    def _allocate(self, req: _Req) -> bool:
        msg, ps = req.msg, self.runner.page_size
        if not req.key:
            req.key = list(msg.input_ids)
            for span in msg.images:
                req.key[span.offset:span.offset + span.length] = [image_pad_id(span.image_hash)] * span.length
            req.positions, req.mrope_delta = mrope_positions(
                req.n, [(s.offset, s.grid_thw, s.time_interval) for s in msg.images], self.cfg.spatial_merge_size)
        # At least one token must be computed to get logits, so never match the whole prompt.
        match = self.radix.match_prefix(req.key[:((req.n - 1) // ps) * ps])
        match = self.states.cut_match(self.radix, req.key, match)  # hybrid: as far as a state snapshot reaches
        need = self.pool.pages_for(req.n) - len(match.pages)
        self.radix.lock(match.node)  # protect the match from the eviction below
        if need > self.pool.num_free:
            self.pool.free(self.radix.evict(need - self.pool.num_free))
        if need > self.pool.num_free or not self.states.acquire(req.room, req.key[:match.length]):
            self.radix.unlock(match.node)
            return False
        req.node, req.cached, req.computed = match.node, match.length, match.length
        req.pages = match.pages + self.pool.alloc(need)
        return True

    def _forward(self) -> None:
        t0 = time.perf_counter()
        batch_reqs, chunks, cuts = plan_forward(self.running, self.max_prefill_tokens, self.chunk, self.states,
                                                self.runner.prefill_graphs)
        dev = self.runner.device
        batch = prefill_batch(batch_reqs, chunks, self.pool)
        batch.state_slots = self.states.slots([r.room for r in batch_reqs])
        batch.state_snapshots = [(i, cut, slot) for i, cut, slot, _ in cuts] or None
        # With DEBUG logs, CUDA events time the forward on the GPU: the stage timeline then tells host from GPU.
        timed = log.isEnabledFor(logging.DEBUG) and dev.type == "cuda"
        if timed:
            t1 = time.perf_counter()
            gpu = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gpu[0].record()
        try:
            logits = self.runner.forward(batch)
        except BaseException:
            self.states.drop_cuts(cuts)
            raise
        self.states.commit_cuts(cuts)
        if timed:
            gpu[1].record()
            t2 = time.perf_counter()
        self.metrics.on_forward(len(batch_reqs))
        done = [i for i, (req, (_, e)) in enumerate(zip(batch_reqs, chunks)) if e == req.n]
        for req, (_, e) in zip(batch_reqs, chunks):
            req.computed = e
            self.states.after_chunk(req.room, req.key, e, req.n)
        if not done:
            return
        reqs = [batch_reqs[i] for i in done]
        first, first_lp = sample_first_tokens(logits[done], reqs)
        if timed:
            log.debug("forward of %d tokens for %s: batch built in %.1f ms, launched in %.1f ms, on the GPU %.1f ms, "
                      "first token %.1f ms after the start", len(batch.input_ids), ",".join(r.msg.rid for r in reqs),
                      (t1 - t0) * 1e3, (t2 - t1) * 1e3, gpu[0].elapsed_time(gpu[1]), (time.perf_counter() - t0) * 1e3)
        for req, toks, lps in zip(reqs, first, first_lp):
            req.first_tokens, req.first_logprobs, req.embeds, req.constraint = toks, lps, None, None
            log.debug("rid=%s prefilled %d tokens (%d cached)", req.msg.rid, req.n, req.cached)  # before any gather
            if self.pool_handle is None and self.engine is None:  # host path: the KV leaves the pages now
                req.transfer = self._host_transfer(req)
            req.state, req.deadline = _State.FINISHED, time.monotonic() + self.timeout_s
            self._to_end(req)
            self.metrics.on_prefilled(req.arrival, req.n, req.cached, req.msg.images)

    def _hand_off(self, req: _Req) -> KVTransfer | None:
        """The transfer for a prefilled request (out of the table) whose decode server just registered: shared
        when that server maps pools of this machine (the pages stay held, the record LENT, until its ``KVAck``),
        None when an engine write into the decode pages started (LENT too), else through host memory (also when
        the engine write cannot start: the decode server takes KV in the message on any path)."""
        reg = req.reg
        if self.engine is not None and reg.regions:
            write = self.writer.start(req, self.states.slot(req.room) if self.states.enabled else -1)
            if not isinstance(write, str):
                req.state, req.deadline, req.write = _State.LENT, time.monotonic() + self.timeout_s, write
                self.reqs[req.room] = req
                return None
            log.warning("rid=%s KV write to the decode server cannot start (%s): sent through host memory", req.rid,
                        write)
        if not (reg.accept_shared and reg.host_id == self.host_id):
            return self._host_transfer(req)
        req.state, req.deadline = _State.LENT, time.monotonic() + self.timeout_s
        self.reqs[req.room] = req
        return shared_transfer(req, self.pool, self.pool_handle, self.states, time.time() + self.timeout_s)

    def _host_transfer(self, req: _Req) -> KVTransfer:
        """Gather a prefilled request's KV into host memory, free its pages, and return the transfer."""
        transfer = host_transfer(req, self.pool, self.runner, self.states)
        self._release(req, insert=True)
        return transfer

    def _release(self, req: _Req, *, insert: bool) -> None:
        """Give a request's pages back: full pages into the radix cache (if its KV is complete), the rest to
        the pool; then unlock its matched prefix. Its state slot (hybrid models) goes back too, and an engine
        write still in flight out of its pages is given up."""
        if req.write is not None:
            self.writer.cancel(req.write)
            req.write = None
        self.states.release(req.room)
        ps = self.runner.page_size
        n_matched = req.cached // ps
        if insert:
            full = req.n // ps
            present = self.radix.insert(req.key[:full * ps], req.pages[:full]) // ps
            # Pages of ours whose tokens the tree already had (another request inserted them meanwhile).
            self.pool.free(req.pages[n_matched:max(present, n_matched)])
            self.pool.free(req.pages[full:])
        else:
            self.pool.free(req.pages[n_matched:])
        self.radix.unlock(req.node)
        req.pages = []

