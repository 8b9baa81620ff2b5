"""The prefill server process: sockets in, :class:`PrefillScheduler` in the middle, KV transfers out.

Sockets (all bound on ``config.host``):
- ``port`` (ROUTER): ``PrefillRequest``, ``AbortRequest``, ``ServerInfoRequest``, ``LoadRequest`` from
  gateways.
- ``embed_port + r`` (PULL): ``ImageEmbeddings`` from encoders for TP rank ``r`` (rank 0 here; ranks 1..tp-1 in
  their own processes, see :mod:`epdserve.tp_runner`). A request is scheduled once every rank holds its
  embeddings (:class:`~epdserve.embed_gate.EmbeddingGate`).
- ``bootstrap_port`` (PULL): ``KVRegister`` and ``KVAck`` from decode servers (SGLang-style bootstrap rendezvous).
Out: one PUSH socket per decode KV endpoint, carrying ``KVTransfer``.
"""

from __future__ import annotations

import logging
import signal

import zmq

from epdserve import transport
from epdserve.config import PrefillConfig
from epdserve.device import resolve_device
from epdserve.embed_gate import EmbeddingGate
from epdserve.kvcache.kv_share import shares_kv
from epdserve.messages import (AbortRequest, ImageEmbeddings, KVAck, KVRegister, LoadRequest, PrefillRequest,
                               ServerInfo, ServerInfoRequest)
from epdserve.model_runner import runner_from_config
from epdserve.prefill.scheduler import PrefillScheduler

log = logging.getLogger("epdserve.prefill")


def serve(config: PrefillConfig) -> None:
    """Load the model (on ``config.tp`` ranks) and run the prefill loop until SIGINT/SIGTERM. Returns 0, or 1
    when a TP rank was lost (its requests fail with an error first).

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
        zmq.ZMQError: a port is taken.
    """
    # The shared (same-host) KV hand-off maps one pool; a TP server's KV is split over its ranks: host path.
    share = shares_kv(config.kv_transfer, resolve_device(config.device)) and config.tp == 1
    model_path, runner, context_length = runner_from_config(config, share_kv=share)
    sched = PrefillScheduler(runner, context_length=context_length,
                             max_prefill_tokens=config.max_prefill_tokens, timeout_s=config.request_timeout_s,
                             chunked_prefill_size=config.chunked_prefill_size)
    tp = runner if config.tp > 1 else None  # a TPRunner: embedding receipts from the other ranks
    gate = EmbeddingGate(config.tp, config.request_timeout_s)
    info = ServerInfo(role="prefill", model_path=model_path, context_length=context_length,
                      page_size=runner.page_size, num_pages=runner.num_pages,
                      embed_endpoints=[f"tcp://{config.host}:{config.embed_port + r}" for r in range(config.tp)],
                      bootstrap_host=config.host, bootstrap_port=config.bootstrap_port)

    ctx = zmq.Context()
    requests = transport.bind(ctx, zmq.ROUTER, config.host, config.port)
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
             "KV hand-off %s)", config.host, config.port, info.embed_endpoints[0], config.host, config.bootstrap_port,
             model_path, runner.device, runner.num_pages, "shared or zmq" if share else "zmq")
    try:
        while not stopping and not runner.failed:
            poller.poll(0 if sched.has_work() else 20)
            while (got := transport.recv_routed(requests)) is not None:
                peer, msg = got
                if isinstance(msg, PrefillRequest):
                    sched.add_request(msg)
                elif isinstance(msg, AbortRequest):
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
                continue
            for endpoint, transfer in transfers:
                if endpoint not in to_decode:
                    to_decode[endpoint] = transport.connect(ctx, zmq.PUSH, endpoint)
                transport.send(to_decode[endpoint], transfer)
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
