"""The decode server process: sockets in, :class:`DecodeScheduler` in the middle, tokens out to gateways.

With ``port`` > 0 an HTTP front (``http_front``, a child process) serves the OpenAI API for a PD
router such as smg and talks to this loop over the ``zmq_port`` socket like any gateway.

Sockets (bound on ``config.host``):
- ``zmq_port`` (ROUTER): ``DecodeRequest``, ``AbortRequest``, ``ServerInfoRequest``, ``LoadRequest`` from gateways;
  token outputs go back to the same peer as ``TokenOutputBatch`` (one message per gateway per step).
- ``kv_port`` (PULL): ``KVTransfer`` from prefill servers, all KV heads; with TP, rank 0 receives it and the
  ranks each keep their heads (:meth:`epdserve.engine.tp_runner.TPRunner.write_kv`), so any prefill TP size feeds any
  decode TP size.
Out: one PUSH socket per prefill bootstrap address, carrying ``KVRegister`` and ``KVAck``.
"""

from __future__ import annotations

import logging
import signal
from collections import defaultdict

import zmq

from epdserve.wire import transport
from epdserve.config import DecodeConfig
from epdserve.decode.scheduler import DecodeScheduler
from epdserve.frontend.process import spawn_front
from epdserve.kvcache.kv_share import shares_kv
from epdserve.wire.messages import (AbortRequest, DecodeRequest, KVTransfer, LoadRequest, ServerInfo, ServerInfoRequest,
                               TokenOutputBatch)
from epdserve.metrics import DecodeMetrics, start_metrics_server
from epdserve.engine.runner_setup import runner_from_config

log = logging.getLogger("epdserve.decode")


def serve(config: DecodeConfig) -> None:
    """Load the model (on ``config.tp`` ranks) and run the decode loop until SIGINT/SIGTERM. Returns 0, or 1
    when a TP rank was lost (its requests fail with an error first).

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
        zmq.ZMQError: a port is taken.
    """
    front = spawn_front("epdserve.decode.http_front", config)  # before the model loads: its /health says 503 meanwhile
    try:
        return _serve(config)
    finally:
        if front is not None:
            front.stop()


def _serve(config: DecodeConfig) -> int:
    graph_bs = 0 if config.disable_cuda_graph else min(config.cuda_graph_max_bs, config.max_running_requests)
    model_path, runner, context_length = runner_from_config(config, cuda_graph_max_bs=graph_bs)
    share = shares_kv(config.kv_transfer, runner.device) and config.tp == 1  # TP ranks take KV by host path
    kv_endpoint = f"tcp://{config.host}:{config.kv_port}"
    metrics = DecodeMetrics()
    sched = DecodeScheduler(runner, context_length=context_length, max_running_requests=config.max_running_requests,
                            timeout_s=config.request_timeout_s, kv_endpoint=kv_endpoint, accept_shared=share,
                            metrics=metrics)
    info = ServerInfo(role="decode", model_path=model_path, context_length=context_length,
                      page_size=runner.page_size, num_pages=runner.num_pages)

    metrics_server = start_metrics_server(metrics.registry, config.host, config.metrics_port, "decode")
    ctx = zmq.Context()
    requests = transport.bind(ctx, zmq.ROUTER, config.host, config.zmq_port)
    kv_in = transport.bind(ctx, zmq.PULL, config.host, config.kv_port)
    to_bootstrap: dict[str, zmq.Socket] = {}
    poller = zmq.Poller()
    for sock in (requests, kv_in):
        poller.register(sock, zmq.POLLIN)

    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    log.info("decode ready on tcp://%s:%d (KV in %s, model=%s, device=%s, %d KV pages, KV hand-off %s, "
             "metrics=%s)", config.host, config.zmq_port, kv_endpoint, model_path, runner.device, runner.num_pages,
             "shared or zmq" if share else "zmq", metrics_server.url)
    try:
        while not stopping and not runner.failed:
            poller.poll(0 if sched.has_work() else 20)
            metrics.update_load(sched.load)
            while (got := transport.recv_routed(requests)) is not None:
                peer, msg = got
                if isinstance(msg, DecodeRequest):
                    endpoint, register = sched.add_request(msg, peer)
                    if (sock := transport.connect_cached(ctx, zmq.PUSH, endpoint, to_bootstrap)) is not None:
                        transport.send(sock, register)
                    else:  # its KV can never arrive
                        sched.fail_request(msg.rid, f"bad bootstrap address {endpoint!r}")
                elif isinstance(msg, AbortRequest):
                    sched.abort(msg.rid)
                elif isinstance(msg, ServerInfoRequest):
                    transport.send(requests, info, identity=peer)
                elif isinstance(msg, LoadRequest):
                    transport.send(requests, sched.load(), identity=peer)
            while (msg := transport.recv(kv_in)) is not None:
                if isinstance(msg, KVTransfer):
                    sched.add_transfer(msg)
            try:
                outputs = sched.step()
            except Exception as e:  # a failed forward must not take the server down
                log.exception("decode step failed")
                sched.fail_running(f"decode failed: {e}")
                outputs, sched.outputs = sched.outputs, []
            for endpoint, ack in sched.take_acks():
                if (sock := transport.connect_cached(ctx, zmq.PUSH, endpoint, to_bootstrap)) is not None:
                    transport.send(sock, ack)
            _send_outputs(requests, outputs)
        if runner.failed:  # a TP rank is gone: fail what this server holds, then stop
            sched.fail_all(f"decode failed: {runner.failed}")
            _send_outputs(requests, sched.outputs)
            return 1
        return 0
    finally:
        runner.close()
        ctx.destroy(linger=1000 if runner.failed else 0)
        metrics_server.close()


def _send_outputs(requests: zmq.Socket, outputs) -> None:
    """One ``TokenOutputBatch`` per gateway peer."""
    by_peer = defaultdict(list)
    for peer, out in outputs:
        by_peer[peer].append(out)
    for peer, outs in by_peer.items():
        transport.send(requests, TokenOutputBatch(outputs=outs), identity=peer)
