"""Prometheus metrics of every stage: one object per server, each with its own ``CollectorRegistry``.

Names follow SGLang's where SGLang has one (``sglang:num_running_reqs`` -> ``epdserve:num_running_reqs``), and
every metric carries a ``stage`` label (``gateway``, ``encoder``, ``prefill``, ``decode``) so one dashboard can
put the stages side by side whatever job names Prometheus gives them. Counters appear with ``_total``,
histograms with ``_bucket``/``_sum``/``_count`` (prometheus-client's exposition).

The servers call the small ``on_*`` methods below from their hot paths (one call per request event, per batch or
per decode step, never per token); everything else (names, buckets, labels) lives here. Nothing is registered in
prometheus-client's global ``REGISTRY``: two servers in one process (tests) never share a counter.

TP ranks: the schedulers run on TP rank 0, so rank 0's process records every metric and serves ``/metrics``;
other ranks record nothing. When ``PROMETHEUS_MULTIPROC_DIR`` is set before the process starts (prometheus-
client's multiprocess mode), :func:`exposition_registry` aggregates the values of every process that wrote
there instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from epdserve.handoff_bytes import kv_transfer_bytes, state_transfer_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "epdserve:"
STAGES = ("gateway", "encoder", "prefill", "decode")

# Request-level latencies, seconds (TTFT, E2E, queue times, time spent in a stage): 1 ms .. 10 min.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 600.0)
# Per-token latencies, seconds (TPOT, ITL): vLLM's buckets, 1 ms .. 80 s.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                         0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Host work of one decode step (tens of microseconds to milliseconds).
STEP_HOST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
# How often the schedulers' gauges (Load) are refreshed from the scheduler loop, in seconds.
LOAD_REFRESH_S = 0.25


class StageMetrics:
    """What every stage exports; subclasses add their own metrics.

    Args:
        stage: the value of the ``stage`` label (one of :data:`STAGES`).

    Attributes:
        registry: this server's ``CollectorRegistry`` (serve it with :func:`start_metrics_server` or
            ``prometheus_client.generate_latest``).
    """

    def __init__(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        self.stage = stage
        self.registry = CollectorRegistry()
        self._errors = self._counter("errors", "Errors by kind (a failed request, a dropped message, a failed step)",
                                     ("kind",))
        self._requests = self._counter("num_requests", "Requests finished by this stage, by outcome", ("outcome",))
        # Not the gateway's: it runs no device work. Divided by wall time: the stage's busy share of its device.
        self.device_busy = None if stage == "gateway" else self._counter(
            "device_busy_seconds", "Seconds of device work (tower calls; prefill and decode forwards: CUDA event "
            "time, including time the GPU gave to other processes meanwhile; wall time on the CPU)")

    # ---- construction helpers: every metric is prefixed, registered here, and labelled with the stage ---------
    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        c = Counter(PREFIX + name, doc, ("stage", *labels), registry=self.registry)
        return c if labels else c.labels(stage=self.stage)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = (), mode: str = "mostrecent"):
        # Under multiprocess mode: one process sets each gauge (TP rank 0), so its latest value is the value;
        # gauges moved with inc/dec need "livesum" (prometheus-client refuses inc on "mostrecent").
        g = Gauge(PREFIX + name, doc, ("stage", *labels), registry=self.registry, multiprocess_mode=mode)
        return g if labels else g.labels(stage=self.stage)

    def _histogram(self, name: str, doc: str, buckets: Iterable[float]):
        return Histogram(PREFIX + name, doc, ("stage",), buckets=tuple(buckets),
                         registry=self.registry).labels(stage=self.stage)

    # ---- shared events ------------------------------------------------------------------------------------
    def on_error(self, kind: str) -> None:
        """Count one error of ``kind`` (a short snake_case word: ``timeout``, ``http_400``, ``INVALID_ARGUMENT``)."""
        self._errors.labels(stage=self.stage, kind=kind).inc()

    def on_request_done(self, outcome: str) -> None:
        """Count one request this stage finished with ``outcome`` (``stop``/``length``/``error``/``abort``/``ok``)."""
        self._requests.labels(stage=self.stage, outcome=outcome).inc()

    def value(self, name: str, **labels: str) -> float:
        """The current value of sample ``name`` (full name, e.g. ``epdserve:prompt_tokens_total``) with
        ``labels`` plus this stage's label; 0.0 when it has not been recorded. For tests and tools."""
        got = self.registry.get_sample_value(name, {"stage": self.stage, **labels})
        return 0.0 if got is None else got


class _LoadGauges:
    """The scheduler gauges of an LM server, set from its ``Load`` (see :meth:`LMStageMetrics.update_load`)."""

    def __init__(self, m: StageMetrics) -> None:
        self.running = m._gauge("num_running_reqs", "Requests being computed (prefill: admitted, chunked prefill "
                                                    "in progress; decode: in the running batch)")
        self.queued = m._gauge("num_queue_reqs", "Requests waiting (prefill: for embeddings or KV pages; decode: "
                                                 "KV received, waiting for pages or a batch slot)")
        self.token_usage = m._gauge("token_usage", "KV pages in use / KV pages in the pool (radix-cached pages "
                                                   "count as used)")
        self.pages_used = m._gauge("kv_pages_used", "KV pages in use")
        self.pages_total = m._gauge("kv_pages_total", "KV pages in the pool")
        self.rooms = m._gauge("bootstrap_rooms", "Bootstrap rooms with state (prefill: registrations and KV "
                                                 "waiting for one; decode: requests waiting for their KV)")
        self.states_used = m._gauge("state_slots_used", "Linear-attention state slots held by requests (hybrid "
                                                        "models such as Qwen3.5; 0 otherwise)")
        self.states_total = m._gauge("state_slots_total", "Linear-attention state slots in the pool (hybrid "
                                                          "models; 0 otherwise)")


class LMStageMetrics(StageMetrics):
    """What the prefill and decode servers share: scheduler gauges, queue time, KV hand-off, batch sizes."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self._load = _LoadGauges(self)
        self._load_at = -1.0
        self.queue_time = self._histogram("queue_time_seconds", "Time a request waited in this stage's queue "
                                          "before it was admitted, seconds", LATENCY_BUCKETS)
        self.stage_latency = self._histogram("stage_latency_seconds", "Time from a request's arrival at this "
                                             "stage to its end there, seconds", LATENCY_BUCKETS)
        self.batch_size = self._histogram("batch_size", "Requests per forward", BATCH_BUCKETS)
        self.kv_bytes = self._counter("kv_transfer_bytes", "Prompt KV bytes handed off (prefill: sent; decode: got)")
        self.state_bytes = self._counter("state_transfer_bytes", "Hybrid models' linear-attention state bytes "
                                         "handed off with the KV (prefill: sent, decode: received)")
        self.kv_engine_bytes = self._counter("kv_engine_bytes", "Of those, written by a transfer engine (nixl, "
                                             "mooncake) into decode pages, all TP ranks' writes")
        self.kv_engine_state_bytes = self._counter("kv_engine_state_bytes", "Hybrid models' linear-attention "
                                                   "state bytes written by a transfer engine into decode state slots, "
                                                   "all TP ranks' writes (also in state_transfer_bytes)")
        self._kv_failures = self._counter("kv_transfer_failures", "KV hand-offs that failed, by reason",
                                          ("reason",))

    def update_load(self, load: Callable[[], Any], now: float | None = None) -> None:
        """Refresh the scheduler gauges from ``load()`` (an ``epdserve.wire.messages.Load``), at most every
        :data:`LOAD_REFRESH_S` seconds; called once per scheduler loop iteration."""
        now = time.monotonic() if now is None else now
        if now - self._load_at < LOAD_REFRESH_S:
            return
        self._load_at = now
        ld = load()
        g = self._load
        g.running.set(ld.num_running_reqs)
        g.queued.set(ld.num_waiting_reqs)
        g.pages_used.set(ld.kv_pages_used)
        g.pages_total.set(ld.kv_pages_total)
        g.token_usage.set(ld.kv_pages_used / ld.kv_pages_total if ld.kv_pages_total else 0.0)
        g.rooms.set(ld.rooms)
        g.states_used.set(ld.state_slots_used)
        g.states_total.set(ld.state_slots_total)
        self._set_extra_load(ld)

    def _set_extra_load(self, load: Any) -> None:
        pass

    def count_hand_off(self, transfer: Any) -> None:
        """Count a ``KVTransfer``'s KV and state bytes, and of them the transfer engines' (0 for an error)."""
        self.kv_bytes.inc(kv_transfer_bytes(transfer))
        self.state_bytes.inc(state_transfer_bytes(transfer))
        if getattr(transfer, "engine_written", False):
            self.kv_engine_bytes.inc(transfer.engine_bytes)
            self.kv_engine_state_bytes.inc(getattr(transfer, "engine_state_bytes", 0))

    def on_kv_failure(self, reason: str) -> None:
        """Count one failed KV hand-off (``no_registration``, ``timeout``, ``bad_kv``, ``prefill_error``)."""
        self._kv_failures.labels(stage=self.stage, reason=reason).inc()


class PrefillMetrics(LMStageMetrics):
    """The prefill server's metrics (see the module docstring for the conventions)."""

    def __init__(self) -> None:
        super().__init__("prefill")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens prefilled (cached ones included)")
        self.cached_tokens = self._counter("cached_tokens", "Prompt tokens whose KV came from the radix cache")
        self.cached_image_tokens = self._counter("cached_image_tokens", "Image tokens among the cached tokens")
        self.image_tokens = self._counter("image_tokens", "Image tokens among the prompt tokens")
        self.cache_hit_rate = self._gauge("cache_hit_rate", "Radix cache hit rate since start: cached tokens / "
                                                            "prompt tokens")
        self.kv_pages_cached = self._gauge("kv_pages_cached", "KV pages held only by the radix cache (evictable)")
        self.pending_embeddings = self._gauge("pending_embeddings", "Requests whose image embeddings are held")
        self._prompt = 0
        self._cached = 0

    def _set_extra_load(self, load: Any) -> None:
        self.kv_pages_cached.set(load.kv_pages_cached)
        self.pending_embeddings.set(load.embeddings)

    def on_admit(self, arrival: float, now: float | None = None) -> None:
        """A request got its pages after waiting since ``arrival`` (``time.monotonic()``)."""
        self.queue_time.observe((time.monotonic() if now is None else now) - arrival)

    def on_forward(self, num_reqs: int) -> None:
        """One prefill forward over ``num_reqs`` requests (chunks)."""
        self.batch_size.observe(num_reqs)

    def on_prefilled(self, arrival: float, prompt_tokens: int, cached_tokens: int,
                     image_spans: Iterable[Any]) -> None:
        """A request's prompt KV is complete.

        Args:
            arrival: ``time.monotonic()`` when the request arrived.
            prompt_tokens, cached_tokens: the request's prompt length and radix-cache hit, in tokens.
            image_spans: its ``ImageSpan``s (``offset``, ``length``); image tokens before ``cached_tokens`` count
                as cached image tokens.
        """
        self.stage_latency.observe(time.monotonic() - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        spans = list(image_spans)
        self.image_tokens.inc(sum(s.length for s in spans))
        self.cached_image_tokens.inc(sum(max(0, min(cached_tokens, s.offset + s.length) - s.offset) for s in spans))
        self._prompt += prompt_tokens
        self._cached += cached_tokens
        self.cache_hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)
        self.on_request_done("ok")

    def on_kv_sent(self, transfer: Any) -> None:
        """A ``KVTransfer`` leaves for decode: stamp ``sent_at`` (wall clock, for decode's hand-off latency) and
        count its bytes (:func:`kv_transfer_bytes`)."""
        transfer.sent_at = time.time()
        self.count_hand_off(transfer)


class DecodeMetrics(LMStageMetrics):
    """The decode server's metrics (see the module docstring for the conventions)."""

    def __init__(self) -> None:
        super().__init__("decode")
        self.generation_tokens = self._counter("generation_tokens", "Output tokens generated (the first one, "
                                               "sampled by prefill, included)")
        self.tpot = self._histogram("time_per_output_token_seconds", "Per request: (finish - admission) / "
                                    "(output tokens - 1), seconds", TOKEN_LATENCY_BUCKETS)
        self.kv_latency = self._histogram("kv_transfer_latency_seconds", "From prefill sending a request's KV "
                                          "to decode receiving it (wall clocks of two processes), seconds",
                                          LATENCY_BUCKETS)
        self.step_launch = self._histogram("step_launch_seconds", "Per decode step: host seconds building and "
                                           "launching it (inputs, graph replay, sampling queued; with constrained "
                                           "rows also filling their masks), the device running the previous step "
                                           "meanwhile", STEP_HOST_BUCKETS)
        self.step_wait = self._histogram("step_wait_seconds", "Per decode step: host seconds blocked on its sampled "
                                         "tokens when they are read, one step later (near 0: the host, not the "
                                         "device, sets the pace)", STEP_HOST_BUCKETS)
        self.grammar_fill = self._histogram("grammar_fill_seconds", "Per decode step with constrained rows: host "
                                            "seconds filling their token bitmasks and launching the mask (the "
                                            "step's forward runs meanwhile)", STEP_HOST_BUCKETS)
        self.grammar_accept = self._histogram("grammar_accept_seconds", "Per decode step with constrained rows: "
                                              "host seconds advancing their matchers by the sampled tokens",
                                              STEP_HOST_BUCKETS)

    def on_kv_received(self, transfer: Any) -> None:
        """A ``KVTransfer`` arrived: count its bytes (:func:`kv_transfer_bytes`) and the hand-off latency (errors
        are counted elsewhere)."""
        self.count_hand_off(transfer)
        if getattr(transfer, "sent_at", 0.0) > 0:
            self.kv_latency.observe(max(0.0, time.time() - transfer.sent_at))

    def on_admit(self, ready_at: float) -> None:
        """A request joined the running batch after its KV had waited since ``ready_at`` (monotonic)."""
        self.queue_time.observe(time.monotonic() - ready_at)

    def on_step(self, batch_size: int) -> None:
        """One decode step launched over ``batch_size`` requests."""
        self.batch_size.observe(batch_size)

    def on_tokens(self, n: int) -> None:
        """``n`` output tokens emitted."""
        self.generation_tokens.inc(n)

    def on_finish(self, outcome: str, arrival: float, admitted: float | None, num_tokens: int) -> None:
        """A request left the decode server (``outcome``: stop, length, error).

        Args:
            arrival: monotonic time its ``DecodeRequest`` arrived.
            admitted: monotonic time it joined the running batch, or None if it never did.
            num_tokens: output tokens it produced.
        """
        now = time.monotonic()
        self.stage_latency.observe(now - arrival)
        if admitted is not None and num_tokens > 1:
            self.tpot.observe((now - admitted) / (num_tokens - 1))
        self.on_request_done(outcome)


class GatewayMetrics(StageMetrics):
    """The gateway's metrics: the client-facing latencies (TTFT, ITL, TPOT, E2E) and the responses' usage."""

    def __init__(self) -> None:
        super().__init__("gateway")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests (usage)")
        self.generation_tokens = self._counter("generation_tokens", "Completion tokens of finished requests "
                                               "(usage)")
        self.cached_tokens = self._counter("cached_tokens", "Cached prompt tokens of finished requests (usage)")
        self.ttft = self._histogram("time_to_first_token_seconds", "From the request's arrival to its first "
                                    "output token, seconds", LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Between two consecutive outputs of a "
                                   "request, seconds", TOKEN_LATENCY_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Per request: (E2E - TTFT) / (completion "
                                    "tokens - 1), seconds", TOKEN_LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "From the request's arrival to its last "
                                   "token, seconds", LATENCY_BUCKETS)
        self.encode_latency = self._histogram("encode_request_latency_seconds", "The gateway's wait for the "
                                              "encoder(s) per request with images, seconds", LATENCY_BUCKETS)
        self.running = self._gauge("num_running_reqs", "Chat completion requests in progress")

    def on_failed(self, kind: str, outcome: str = "error") -> None:
        """A request failed (``kind`` as in :meth:`on_error`): counts the error and the request's ``outcome``."""
        self.on_error(kind)
        self.on_request_done(outcome)

    def trace(self) -> RequestTrace:
        """Start timing one request (now is its arrival)."""
        return RequestTrace(self)


class RequestTrace:
    """The timings of one chat completion at the gateway: :meth:`output` per ``TokenOutput``, then :meth:`finish`
    (or :meth:`fail`) once. Used from one event loop."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.done = False

    async def encode(self, work: Awaitable[T]) -> T:
        """Await ``work`` (the request's encode) and observe how long the gateway waited for it."""
        start = time.monotonic()
        try:
            return await work
        finally:
            self.metrics.encode_latency.observe(time.monotonic() - start)

    def output(self, num_tokens: int) -> None:
        """An output with ``num_tokens`` new token ids reached the gateway (TTFT at the first, ITL after)."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finish(self, finish_reason: str, usage: Any) -> None:
        """The response is complete with ``usage`` (the response's ``Usage``): counts its tokens, observes E2E and
        TPOT. Only the first :meth:`finish` or :meth:`fail` counts."""
        if self.done:
            return
        self.done = True
        m, now = self.metrics, time.monotonic()
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.cached_tokens.inc(usage.prompt_tokens_details.cached_tokens)
        m.e2e.observe(now - self.arrival)
        if self.first is not None and usage.completion_tokens > 1:
            m.tpot.observe((now - self.first) / (usage.completion_tokens - 1))
        m.on_request_done(finish_reason)

    def fail(self, kind: str, outcome: str = "error") -> None:
        """The request ended without a complete response (``kind``: generation_failed, client_disconnected, ...)."""
        if self.done:
            return
        self.done = True
        self.metrics.on_failed(kind, outcome)


def exposition_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """The registry to expose: ``registry`` itself, or under prometheus-client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set) a collector over every process's values."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return registry
    from prometheus_client import multiprocess

    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged)
    return merged


class MetricsServer:
    """prometheus-client's HTTP server for one registry, on a daemon thread (any path answers the exposition).

    A port that cannot be bound does not stop the server it belongs to (serving matters more than its
    metrics): the failure is logged as a warning, :attr:`url` says ``"off"`` and :meth:`close` does nothing.

    Args:
        registry: what to expose.
        host: address to bind (internal servers: 127.0.0.1 unless ``--host`` says otherwise).
        port: TCP port; 0 binds a free one (see :attr:`port`).
        role: the server's name for the warning.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int, role: str = "server") -> None:
        self.host = host
        self.port = 0
        self._httpd = self._thread = None
        try:
            self._httpd, self._thread = start_http_server(port, host, exposition_registry(registry))
        except OSError as e:
            log.warning("%s: no /metrics, cannot bind %s:%d (%s); pass a free --metrics-port", role, host, port, e)
            return
        self.port = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        """``http://host:port/metrics``, or ``"off"`` when the port could not be bound."""
        return f"http://{self.host}:{self.port}/metrics" if self._httpd is not None else "off"

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2)
        self._httpd = None


def start_metrics_server(registry: CollectorRegistry, host: str, port: int, role: str) -> MetricsServer:
    """Start a :class:`MetricsServer` for ``role`` (its URL goes in the server's ready line)."""
    return MetricsServer(registry, host, port, role)


__all__ = [
    "PREFIX", "STAGES", "StageMetrics", "LMStageMetrics", "PrefillMetrics", "DecodeMetrics",
    "GatewayMetrics", "RequestTrace", "MetricsServer", "start_metrics_server", "exposition_registry",
]
