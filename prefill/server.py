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
import signal

import zmq

from epdserve.wire import transport
from epdserve.config import PrefillConfig
from epdserve.device import resolve_device
from epdserve.frontend.process import spawn_front
from epdserve.prefill.embed_gate import EmbeddingGate
from epdserve.kvcache.kv_share import shares_kv
from epdserve.wire.messages import (AbortRequest, ImageEmbeddings, KVAck, KVRegister, LoadRequest, PrefillRequest,
                               ServerInfo, ServerInfoRequest)
from epdserve.metrics import PrefillMetrics, start_metrics_server
from epdserve.engine.runner_setup import runner_from_config
from epdserve.prefill.replies import PrefillReplies
from epdserve.prefill.scheduler import PrefillScheduler

log = logging.getLogger("epdserve.prefill")


def serve(config: PrefillConfig) -> None:
    """Load the model (on ``config.tp`` ranks) and run the prefill loop until SIGINT/SIGTERM. Returns 0, or 1
    when a TP rank was lost (its requests fail with an error first).

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
        zmq.ZMQError: a port is taken.
    """
    front = spawn_front("epdserve.prefill.http_front", config)  # before the model loads: its /health says 503 meanwhile
    try:
        return _serve(config)
    finally:
        if front is not None:
            front.stop()


def _serve(config: PrefillConfig) -> int:
    # The shared (same-host) KV hand-off maps one pool; a TP server's KV is split over its ranks: host path.
    share = shares_kv(config.kv_transfer, resolve_device(config.device)) and config.tp == 1
    model_path, runner, context_length = runner_from_config(config, share_kv=share)
    metrics = PrefillMetrics()
    sched = PrefillScheduler(runner, context_length=context_length,
                             max_prefill_tokens=config.max_prefill_tokens, timeout_s=config.request_timeout_s,
                             chunked_prefill_size=config.chunked_prefill_size, metrics=metrics)
    tp = runner if config.tp > 1 else None  # a TPRunner: embedding receipts from the other ranks
    gate = EmbeddingGate(config.tp, config.request_timeout_s)
    info = ServerInfo(role="prefill", model_path=model_path, context_length=context_length,
                      page_size=runner.page_size, num_pages=runner.num_pages,
                      embed_endpoints=[f"tcp://{config.host}:{config.embed_port}",
                                       *(tp.embed_endpoints if tp else [])],
                      bootstrap_host=config.host, bootstrap_port=config.bootstrap_port)

    metrics_server = start_metrics_server(metrics.registry, config.host, config.metrics_port, "prefill")
    ctx = zmq.Context()
    requests = transport.bind(ctx, zmq.ROUTER, config.host, config.zmq_port)
    replies = PrefillReplies(config.request_timeout_s * 2)
    embeds = transport.bind(ctx, zmq.PULL, config.host, config.embed_port)
    bootstrap = transport.bind(ctx, zmq.PULL, config.host, config.bootstrap_port)
    to_decode: dict[str, zmq.Socket] = {}
    poller = zmq.Poller()
    for sock in (requests, embeds, bootstrap, *([tp.ctrl] if tp else [])):
        poller.register(sock, zmq.POLLIN)

    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    log.info("prefill ready on tcp://%s:%d (embeddings %s, bootstrap %s:%d, model=%s, device=%s, %d KV pages, "
             "KV hand-off %s, metrics=%s)", config.host, config.zmq_port, info.embed_endpoints[0], config.host,
             config.bootstrap_port, model_path, runner.device, runner.num_pages, "shared or zmq" if share else "zmq",
             metrics_server.url)
    try:
        while not stopping and not runner.failed:
            poller.poll(0 if sched.has_work() else 20)
            metrics.update_load(sched.load)
            while (got := transport.recv_routed(requests)) is not None:
                peer, msg = got
                if isinstance(msg, PrefillRequest):
                    replies.track(peer, msg)
                    sched.add_request(msg)
                elif isinstance(msg, AbortRequest):
                    replies.forget(msg.rid)
                    sched.abort(msg.rid)
                    gate.abort(msg.rid)
                elif isinstance(msg, ServerInfoRequest):
                    transport.send(requests, info, identity=peer)
                elif isinstance(msg, LoadRequest):
                    transport.send(requests, sched.load(), identity=peer)
            while (msg := transport.recv(embeds)) is not None:
                if isinstance(msg, ImageEmbeddings):
                    gate.add_local(msg)
            for receipt in tp.receipts() if tp else ():
                gate.add_receipt(receipt)
            gate.expire()
            for msg in gate.ready():
                sched.add_embeddings(msg)
            while (msg := transport.recv(bootstrap)) is not None:
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
                if (sock := transport.connect_cached(ctx, zmq.PUSH, endpoint, to_decode)) is not None:
                    transport.send(sock, transfer)
            for peer, out in replies.collect(sched.finished, [t for _, t in transfers]):
                transport.send(requests, out, identity=peer)
            if tp:
                tp.release_embeddings(gate.releasable(sched.embeds))
        if runner.failed:  # a TP rank is gone: fail what this server holds, then stop
            sched.fail_all(f"prefill failed: {runner.failed}")
            for endpoint, transfer in sched.step():
                transport.send(to_decode.get(endpoint) or transport.connect(ctx, zmq.PUSH, endpoint), transfer)
            return 1
        return 0
    finally:
        runner.close()
        ctx.destroy(linger=1000 if runner.failed else 0)
        metrics_server.close()
