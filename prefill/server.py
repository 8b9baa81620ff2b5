"""The prefill server process: sockets in, :class:`PrefillScheduler` in the middle, KV transfers out.

With ``port`` > 0 an HTTP front (``http_front``, a child process) serves the OpenAI API for a PD
router such as smg and talks to this loop over the ``zmq_port`` socket like any gateway.

Sockets (all bound on ``config.host``):
- ``zmq_port`` (ROUTER): ``PrefillRequest``, ``AbortRequest``, ``ServerInfoRequest``, ``LoadRequest`` from
  gateways.
- ``embed_port`` (PULL): ``ImageEmbeddings`` from encoders for TP rank 0; ranks 1..tp-1 bind their own (in
  their own processes, see :mod:`epdserve.engine.tp_runner`). A request is scheduled once every rank holds its
  embeddings (:class:`~epdserve.prefill.embed_gate.EmbeddingGate`).
- ``bootstrap_port`` (PULL): ``KVRegister`` and ``KVAck`` from decode servers (SGLang-style bootstrap rendezvous).
Out: one PUSH socket per decode KV endpoint, carrying ``KVTransfer``.
"""

from __future__ import annotations

import logging

import zmq

from epdserve.wire import transport
from epdserve.config import PrefillConfig
from epdserve.device import resolve_device
from epdserve.engine.busy import track_device_busy
from epdserve.engine.grammar import GrammarCompiler
from epdserve.engine.server import StageServer, kv_shared, register_kv_engine, serve_with_front, start_kv_engine
from epdserve.kvcache.kv_share import host_id, shares_kv
from epdserve.wire.device_share import take_embeddings
from epdserve.prefill.embed_gate import EmbeddingGate
from epdserve.wire.messages import AbortRequest, ImageEmbeddings, KVAck, KVRegister, PrefillRequest, ServerInfo
from epdserve.metrics import PrefillMetrics
from epdserve.logging_setup import startup_summary
from epdserve.engine.runner_setup import runner_from_config
from epdserve.prefill.replies import PrefillReplies
from epdserve.prefill.scheduler import PrefillScheduler

log = logging.getLogger("epdserve.prefill")


def serve(config: PrefillConfig) -> int:
    """Load the model (on ``config.tp`` ranks) and run the prefill loop until SIGINT/SIGTERM. Returns 0, or 1
    when a TP rank was lost (its requests fail with an error first).

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
        zmq.ZMQError: a port is taken.
    """
    return serve_with_front("epdserve.prefill.http_front", config, _serve)


def _serve(config: PrefillConfig) -> int:
    device = resolve_device(config.device)
    share = kv_shared(config, device)
    engine = start_kv_engine(config)  # before the model loads: a missing engine package fails at once
    model_path, runner, context_length = runner_from_config(config, share_kv=share)
    register_kv_engine(engine, runner)
    metrics = PrefillMetrics()
    track_device_busy(runner, metrics.device_busy.inc, "prefill")
    grammars = GrammarCompiler(model_path, runner.config.vocab_size, list(runner.config.eos_token_ids))
    sched = PrefillScheduler(runner, context_length=context_length,
                             max_prefill_tokens=config.max_prefill_tokens, timeout_s=config.request_timeout_s,
                             chunked_prefill_size=config.chunked_prefill_size, metrics=metrics,
                             state_snapshot_slots=config.state_snapshot_slots, grammars=grammars, engine=engine)
    tp = runner if config.tp > 1 else None  # a TPRunner: embedding receipts from the other ranks
    info = ServerInfo(role="prefill", model_path=model_path, context_length=context_length,
                      page_size=runner.page_size, num_pages=runner.num_pages,
                      embed_endpoints=[f"tcp://{config.host}:{config.embed_port}",
                                       *(tp.embed_endpoints if tp else [])],
                      bootstrap_host=config.host, bootstrap_port=config.bootstrap_port,
                      embed_host_id=host_id() if shares_kv(config.kv_transfer, device) and device.type == "cuda"
                      else "")
    try:
        return _PrefillServer(config, runner, sched, metrics, info, tp=tp, share=share).run()
    finally:
        grammars.close()
        if engine is not None:
            engine.close()


class _PrefillServer(StageServer):
    """The prefill stage's part of the loop: embeddings (gated on every TP rank), decode registrations and
    acks, a scheduler step, KV transfers out, replies to the HTTP front."""

    def __init__(self, config: PrefillConfig, runner, sched: PrefillScheduler, metrics: PrefillMetrics,
                 info: ServerInfo, *, tp, share: bool):
        super().__init__("prefill", config, runner, sched, metrics, info)
        self.tp, self.share = tp, share
        self.gate = EmbeddingGate(config.tp, config.request_timeout_s)
        self.replies = PrefillReplies(config.request_timeout_s * 2)
        self.embeds = self.bind(zmq.PULL, config.embed_port)
        self.bootstrap = self.bind(zmq.PULL, config.bootstrap_port)
        if tp:
            self.poller.register(tp.ctrl, zmq.POLLIN)

    def log_ready(self) -> None:
        c = self.config
        log.info("prefill ready on tcp://%s:%d (embeddings %s, bootstrap %s:%d, model=%s, device=%s, %d KV pages, "
                 "KV hand-off %s, metrics=%s); %s", c.host, c.zmq_port, self.info.embed_endpoints[0], c.host,
                 c.bootstrap_port, self.info.model_path, self.runner.device, self.runner.num_pages,
                 "shared or zmq" if self.share else self.sched.engine.name if self.sched.engine else "zmq",
                 self.metrics_server.url, startup_summary(self.runner.startup_s))

    def on_request(self, peer: bytes, msg) -> None:
        if isinstance(msg, PrefillRequest):
            self.replies.track(peer, msg)
            self.sched.add_request(msg)
        elif isinstance(msg, AbortRequest) and msg.index is None:  # a choice's abort is decode's alone
            self.replies.forget(msg.rid)
            self.sched.abort(msg.rid)
            self.gate.abort(msg.rid)

    def tick(self) -> None:
        sched, gate, tp = self.sched, self.gate, self.tp
        while (msg := transport.recv(self.embeds)) is not None:
            if isinstance(msg, ImageEmbeddings) and (msg := take_embeddings(msg, self.runner.device)) is not None:
                gate.add_local(msg)
        for receipt in tp.receipts() if tp else ():
            gate.add_receipt(receipt)
        gate.expire()
        for msg in gate.ready():
            sched.add_embeddings(msg)
        while (msg := transport.recv(self.bootstrap)) is not None:
            if isinstance(msg, KVRegister):
                sched.register(msg)
            elif isinstance(msg, KVAck):
                sched.ack(msg)
        try:
            transfers = sched.step()
        except Exception as e:  # a failed forward must not take the server down
            log.exception("prefill step failed")
            sched.fail_running(f"prefill failed: {e}")
            transfers = []
        for endpoint, transfer in transfers:
            self.push(endpoint, transfer)
        for peer, out in self.replies.collect(sched.finished, [t for _, t in transfers]):
            self.reply(peer, out)
        if tp:
            tp.release_embeddings(gate.releasable(sched.embeds))

    def on_rank_lost(self) -> None:
        self.sched.fail_all(f"prefill failed: {self.runner.failed}")
        for endpoint, transfer in self.sched.step():
            sock = self.pushes.get(endpoint) or transport.connect(self.ctx, zmq.PUSH, endpoint)
            transport.send(sock, transfer)
