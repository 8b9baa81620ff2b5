"""The skeleton the prefill and decode servers share: a metrics server, a ZeroMQ context, the ROUTER socket
gateways (and the stage's HTTP front) talk to, the poll loop that answers ``ServerInfoRequest`` and
``LoadRequest`` itself, SIGINT/SIGTERM handling, and the shutdown order.

A stage subclasses :class:`StageServer` and keeps only what is its own: its other sockets, its request
messages (:meth:`StageServer.on_request`), the rest of one loop turn (:meth:`StageServer.tick`), its ready
line and what it does when a TP rank is lost.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from epdserve.engine.shutdown import arm_stop_deadline
from epdserve.frontend.process import spawn_front
from epdserve.kvcache.engine import KV_ENGINES, KVEngine, make_engine
from epdserve.kvcache.kv_share import shares_kv
from epdserve.metrics import start_metrics_server
from epdserve.models.qwen3_5_deltanet import deltanet_heads
from epdserve.wire import transport
from epdserve.wire.messages import LoadRequest, ServerInfo, ServerInfoRequest

_IDLE_POLL_MS = 20  # how long an idle loop waits for a message before looking at its deadlines again

# A loop turn this long is logged: gateways answer heartbeats only between turns and take a server silent for
# their --stage-timeout-s (10 s by default) as down.
_SLOW_TURN_S = 2.5

log = logging.getLogger(__name__)


def kv_shared(config: Any, device: torch.device) -> bool:
    """Whether this server hands KV over by the shared (same-host) path as well as through host memory: as
    ``--kv-transfer`` says and the device allows, and only with TP 1 (the shared path maps one pool, while a
    TP server's KV is split over its ranks)."""
    return shares_kv(config.kv_transfer, device) and config.tp == 1


def start_kv_engine(config: Any) -> KVEngine | None:
    """The transfer engine ``--kv-transfer nixl|mooncake`` asks for, started before the model loads (so a missing
    package fails at once); None for the other modes. Every TP rank starts its own (one per process, each for its
    rank's KV pool shard: :mod:`epdserve.kvcache.engine`).

    Raises:
        KVEngineError: the engine's package is not installed or the engine cannot start.
    """
    if config.kv_transfer not in KV_ENGINES:
        return None
    return make_engine(config.kv_transfer, config.host)


def register_kv_engine(engine: KVEngine | None, runner) -> None:
    """Register ``runner``'s KV pool (this TP rank's shard, holding the KV heads from ``runner.heads.kv_start``
    on) with ``engine`` (if any), and a hybrid model's state pool (this rank's DeltaNet heads) beside it.

    Raises:
        KVEngineError: the engine refused the memory.
    """
    if engine is None:
        return
    engine.register(runner.kv_pool.buffer, head_start=runner.heads.kv_start)
    if (pool := getattr(runner, "state_pool", None)) is not None:
        key_start, _, value_start, _ = deltanet_heads(runner.config, runner.tp)
        engine.register_state(pool.conv_buffer, pool.recurrent_buffer, key_start, value_start)


class StageServer:
    """One prefill or decode server's sockets and loop around its scheduler.

    Args:
        role: ``"prefill"`` or ``"decode"`` (the metrics server's name).
        config: the stage's config (``host``, ``zmq_port``, ``metrics_port`` are read here).
        runner: its model runner (``ModelRunner`` or ``TPRunner``): ``failed`` ends the loop, ``close()`` is
            called on the way out.
        sched: its scheduler (``has_work()``, ``load()``).
        metrics: its metrics (``registry``, ``update_load``).
        info: the ``ServerInfo`` answered to ``ServerInfoRequest``.

    Raises:
        zmq.ZMQError: the ZMQ port is taken (the metrics server's port: ``OSError``).
    """

    def __init__(self, role: str, config: Any, runner: Any, sched: Any, metrics: Any, info: ServerInfo):
        self.config, self.runner, self.sched, self.metrics, self.info = config, runner, sched, metrics, info
        self.metrics_server = start_metrics_server(metrics.registry, config.host, config.metrics_port, role)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.requests = self.bind(zmq.ROUTER, config.zmq_port)
        self.pushes: dict[str, zmq.Socket] = {}  # endpoint -> PUSH socket to another server, connected once

    def bind(self, kind: int, port: int) -> zmq.Socket:
        """A socket of ``kind`` bound on ``config.host:port`` whose messages wake the loop.

        Raises:
            zmq.ZMQError: the port is taken.
        """
        sock = transport.bind(self.ctx, kind, self.config.host, port)
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def push(self, endpoint: str, msg: Any) -> bool:
        """Send ``msg`` to another server's PULL ``endpoint``; False (logged by the transport) when ZMQ rejects
        the endpoint, which came from another process."""
        sock = transport.connect_cached(self.ctx, zmq.PUSH, endpoint, self.pushes)
        if sock is not None:
            transport.send(sock, msg)
        return sock is not None

    def reply(self, peer: bytes, msg: Any) -> None:
        """Send ``msg`` back to the ROUTER peer ``peer`` (a gateway or the HTTP front)."""
        transport.send(self.requests, msg, identity=peer)

    # ---- what a stage fills in ----------------------------------------------------------------------------
    def idle_poll_ms(self) -> int:
        """How long the loop waits for a message when its scheduler has no work (milliseconds)."""
        return _IDLE_POLL_MS

    def log_ready(self) -> None:
        """Log the stage's ready line (tests and launchers wait for it)."""
        raise NotImplementedError

    def on_request(self, peer: bytes, msg: Any) -> None:
        """A message on the ROUTER socket other than ``ServerInfoRequest`` and ``LoadRequest``."""
        raise NotImplementedError

    def tick(self) -> None:
        """The rest of one loop turn, after the ROUTER socket is drained: other sockets, a scheduler step and
        its outputs."""
        raise NotImplementedError

    def on_rank_lost(self) -> None:
        """A TP rank is gone: fail what this server holds and send those errors before it stops."""
        raise NotImplementedError

    def _check_turn(self, seconds: float) -> None:
        # A turn near the gateways' stage timeout gets this server taken as down and its requests failed: say
        # so where it happens, with the load the turn ran under.
        if seconds > _SLOW_TURN_S:
            log.warning("one loop turn took %.1f s (heartbeats wait for it; %s)", seconds, self.sched.load())

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (returns 0) or until a TP rank is lost (returns 1, after
        :meth:`on_rank_lost`); closes the runner (a TP server's ranks too), the sockets and the metrics server
        either way. After a signal the process exits within :data:`~epdserve.engine.shutdown.STOP_DEADLINE_S`
        seconds, with exit code 1 and every thread's stack if its teardown hangs."""
        stopping = []

        def stop(*_) -> None:
            if not stopping:
                arm_stop_deadline(f"{self.info.role} server")
            stopping.append(True)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)
        self.log_ready()
        try:
            while not stopping and not self.runner.failed:
                self.poller.poll(0 if self.sched.has_work() else self.idle_poll_ms())
                self.metrics.update_load(self.sched.load)
                while (got := transport.recv_routed(self.requests)) is not None:
                    peer, msg = got
                    if isinstance(msg, ServerInfoRequest):
                        self.reply(peer, self.info)
                    elif isinstance(msg, LoadRequest):
                        self.reply(peer, self.sched.load())
                    else:
                        self.on_request(peer, msg)
                t0 = time.monotonic()
                self.tick()
                self._check_turn(time.monotonic() - t0)
            if self.runner.failed:
                self.on_rank_lost()
                return 1
            return 0
        finally:
            self.runner.close()
            # Linger only when errors were just queued for other servers (a lost rank): they must get out.
            self.ctx.destroy(linger=1000 if self.runner.failed else 0)
            self.metrics_server.close()


def serve_with_front(front_module: str, config: Any, serve: Callable[[Any], int]) -> int:
    """Start the stage's HTTP front (``python -m front_module``, a child process; see
    :func:`epdserve.frontend.process.spawn_front`; none when ``config.port`` is 0) before the model loads, so its
    ``/health`` answers 503 meanwhile; run ``serve(config)``; stop the front whatever happens. Returns ``serve``'s
    exit code."""
    front = spawn_front(front_module, config)
    try:
        return serve(config)
    finally:
        if front is not None:
            front.stop()
