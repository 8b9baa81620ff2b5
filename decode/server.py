"""The decode server process: sockets in, :class:`DecodeScheduler` in the middle, tokens out to gateways.

With ``port`` > 0 an HTTP front (``http_front``, a child process) serves the OpenAI API for a PD
router such as smg and talks to this loop over the ``zmq_port`` socket like any gateway.

Sockets (bound on ``config.host``):
- ``zmq_port`` (ROUTER): ``DecodeRequest``, ``AbortRequest``, ``ServerInfoRequest``, ``LoadRequest`` from gateways;
  token outputs go back to the same peer as ``TokenOutputBatch`` (one message per gateway per step).
- ``kv_port`` (PULL): ``KVTransfer`` from prefill servers, all KV heads; with TP, rank 0 receives it and the
  ranks each keep their heads (:meth:`epdserve.engine.tp_runner.TPRunner.write_kv`), so any prefill TP size feeds any
  decode TP size. With ``--kv-transfer nixl|mooncake`` every rank's engine offers its pool shard at bootstrap and
  the prefill ranks write each decode rank its KV heads straight into its pages (:mod:`epdserve.kvcache.engine`).
Out: one PUSH socket per prefill bootstrap address, carrying ``KVRegister`` and ``KVAck``.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import zmq

from epdserve.wire import transport
from epdserve.config import DecodeConfig
from epdserve.decode.scheduler import DecodeScheduler
from epdserve.engine.busy import track_device_busy
from epdserve.engine.grammar import GrammarCompiler
from epdserve.engine.server import StageServer, kv_shared, register_kv_engine, serve_with_front, start_kv_engine
from epdserve.wire.messages import AbortRequest, DecodeRequest, KVTransfer, ServerInfo, TokenOutputBatch
from epdserve.metrics import DecodeMetrics
from epdserve.logging_setup import startup_summary
from epdserve.engine.runner_setup import runner_from_config

log = logging.getLogger("epdserve.decode")


def serve(config: DecodeConfig) -> int:
    """Load the model (on ``config.tp`` ranks) and run the decode loop until SIGINT/SIGTERM. Returns 0, or 1
    when a TP rank was lost (its requests fail with an error first).

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
        zmq.ZMQError: a port is taken.
    """
    return serve_with_front("epdserve.decode.http_front", config, _serve)


def _serve(config: DecodeConfig) -> int:
    graph_bs = 0 if config.disable_cuda_graph else min(config.cuda_graph_max_bs, config.max_running_requests)
    engine = start_kv_engine(config)  # before the model loads: a missing engine package fails at once
    model_path, runner, context_length = runner_from_config(config, cuda_graph_max_bs=graph_bs)
    register_kv_engine(engine, runner)
    share = kv_shared(config, runner.device)  # TP ranks take KV by host path
    kv_endpoint = f"tcp://{config.host}:{config.kv_port}"
    metrics = DecodeMetrics()
    track_device_busy(runner, metrics.device_busy.inc, "decode")
    grammars = GrammarCompiler(model_path, runner.config.vocab_size, list(runner.config.eos_token_ids))
    sched = DecodeScheduler(runner, context_length=context_length, max_running_requests=config.max_running_requests,
                            timeout_s=config.request_timeout_s, kv_endpoint=kv_endpoint, accept_shared=share,
                            metrics=metrics, grammars=grammars, engine=engine)
    info = ServerInfo(role="decode", model_path=model_path, context_length=context_length,
                      page_size=runner.page_size, num_pages=runner.num_pages)
    try:
        return _DecodeServer(config, runner, sched, metrics, info, kv_endpoint=kv_endpoint, share=share).run()
    finally:
        grammars.close()
        if engine is not None:
            engine.close()


class _DecodeServer(StageServer):
    """The decode stage's part of the loop: registrations out to prefill bootstrap ports, KV in, a scheduler
    step, acks out, token outputs back to the gateways."""

    def __init__(self, config: DecodeConfig, runner, sched: DecodeScheduler, metrics: DecodeMetrics,
                 info: ServerInfo, *, kv_endpoint: str, share: bool):
        super().__init__("decode", config, runner, sched, metrics, info)
        self.kv_endpoint, self.share = kv_endpoint, share
        self.kv_in = self.bind(zmq.PULL, config.kv_port)

    def log_ready(self) -> None:
        c = self.config
        log.info("decode ready on tcp://%s:%d (KV in %s, model=%s, device=%s, %d KV pages, KV hand-off %s, "
                 "metrics=%s); %s", c.host, c.zmq_port, self.kv_endpoint, self.info.model_path, self.runner.device,
                 self.runner.num_pages, "shared or zmq" if self.share else
                 (r := self.sched.engine_pages.regions) and r[0].engine or "zmq", self.metrics_server.url,
                 startup_summary(self.runner.startup_s))

    def idle_poll_ms(self) -> int:
        # A transfer engine writing into reserved pages progresses on this loop's turns (KVEngine.progress):
        # over TCP a write lands only as it does, so turn every millisecond while one may be in flight.
        if self.sched.engine_pages.engine is not None and self.sched.pending:
            return 1
        return super().idle_poll_ms()

    def on_request(self, peer: bytes, msg) -> None:
        if isinstance(msg, DecodeRequest):
            endpoint, register = self.sched.add_request(msg, peer)
            if not self.push(endpoint, register):  # its KV can never arrive
                self.sched.fail_request(msg.rid, f"bad bootstrap address {endpoint!r}")
        elif isinstance(msg, AbortRequest):
            self.sched.abort(msg.rid, msg.index)

    def tick(self) -> None:
        sched = self.sched
        while (msg := transport.recv(self.kv_in)) is not None:
            if isinstance(msg, KVTransfer):
                sched.add_transfer(msg)
        try:
            outputs = sched.step()
        except Exception as e:  # a failed forward must not take the server down
            log.exception("decode step failed")
            sched.fail_running(f"decode failed: {e}")
            outputs, sched.outputs = sched.outputs, []
        for endpoint, ack in sched.take_acks():
            self.push(endpoint, ack)
        _send_outputs(self.requests, outputs)

    def on_rank_lost(self) -> None:
        self.sched.fail_all(f"decode failed: {self.runner.failed}")
        _send_outputs(self.requests, self.sched.outputs)


def _send_outputs(requests: zmq.Socket, outputs) -> None:
    """One ``TokenOutputBatch`` per gateway peer."""
    by_peer = defaultdict(list)
    for peer, out in outputs:
        by_peer[peer].append(out)
    for peer, outs in by_peer.items():
        transport.send(requests, TokenOutputBatch(outputs=outs), identity=peer)
