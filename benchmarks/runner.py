"""The load generator: warm-up, Poisson (or gamma) arrivals, a concurrency cap, a time limit, a progress bar.

Every request of a run is sent by one asyncio task on one ``aiohttp.ClientSession`` whose connection pool is
unbounded, so no request waits inside the client for a connection (a wait that would be charged to the server
as TTFT). The only waits are the ones asked for: the arrival schedule and ``--max-concurrency``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from .client import RequestRecord, stream_chat
from .datasets import BenchRequest

LOOP_LAG_INTERVAL_S = 0.01  # how often the event-loop lag probe runs; 100 probes/s cost nothing measurable


class BenchmarkError(RuntimeError):
    """The benchmark cannot run meaningfully (e.g. every warm-up request failed: the server is not serving)."""


@dataclass(frozen=True)
class LoadConfig:
    """How requests are offered.

    Attributes:
        request_rate: mean arrivals per second; ``math.inf`` sends everything at once.
        burstiness: shape of the gamma-distributed gaps; 1.0 is a Poisson process, lower is burstier.
        max_concurrency: most requests in flight at once (``None``: no cap).
        duration_s: stop issuing requests this many seconds after the start (in-flight ones finish and count).
        warmup: requests sent before the measured run, concurrently up to ``max_concurrency``; not counted.
        seed: seeds the arrival gaps.
        timeout_s: per request, from connect to ``[DONE]``; ``None``: no limit.
    """

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    timeout_s: float | None = 600.0


@dataclass
class RunResult:
    """The outcome of one run. ``records`` are the measured requests that were issued, in issue order."""

    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    duration_s: float
    not_issued: int
    stopped_by: str  # "num_prompts" (all sent) or "duration"
    loop_lag_s: list[float] = field(default_factory=list)


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: the first at 0, then gamma gaps of mean ``1/rate`` and shape
    ``burstiness`` (exponential gaps, i.e. Poisson arrivals, at 1.0); all zeros for an infinite rate."""
    if num <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(num)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def run_benchmark(
    url: str,
    bodies: list[bytes],
    requests: list[BenchRequest],
    load: LoadConfig,
    *,
    headers: dict[str, str] | None = None,
    show_progress: bool = True,
    keep_text: bool = False,
    before_measured: Callable[[], None] | None = None,
) -> RunResult:
    """Run one benchmark (blocking). ``bodies[i]`` is the serialized body of ``requests[i]``; the first
    ``load.warmup`` of them are the warm-up. ``before_measured()`` runs (blocking) between the warm-up and the
    measured requests, with nothing in flight (``--scrape-metrics`` scrapes there). Raises
    :class:`BenchmarkError` when every warm-up request failed."""
    return asyncio.run(
        _run(url, bodies, requests, load, headers=headers or {}, show_progress=show_progress, keep_text=keep_text,
             before_measured=before_measured)
    )


@dataclass
class _Phase:
    """A progress bar (warm-up or measured) and the failures shown on it."""

    bar: tqdm
    failed: int = 0

    def done(self, rec: RequestRecord) -> None:
        self.bar.update(1)
        if not rec.success:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed)


async def _run(url, bodies, requests, load: LoadConfig, *, headers, show_progress, keep_text,
               before_measured=None) -> RunResult:
    # aiohttp, not httpx: its C HTTP parser costs the client ~4x less CPU per streamed event (docs/performance.md),
    # and one httpx client at 128 concurrent streams was saturated before the server was (eighth session).
    # limit=0: no connection cap (--max-concurrency is the cap). trust_env=False: a benchmark measures the
    # server, not an HTTP proxy picked up from the environment. No session timeout: stream_chat bounds each
    # whole request with load.timeout_s instead. keepalive_timeout under uvicorn's default 5 s (aiohttp's own is
    # 15 s): against a server that closes idle connections at 5 s, reusing one then races its close (ReadError).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     trust_env=False) as client:
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()

        async def send(i: int, t0: float, scheduled: float, deadline: float | None, phase: _Phase):
            req = requests[i]
            async with sem:
                if deadline is not None and time.perf_counter() >= deadline:
                    return None  # its slot came after --duration: never issued
                rec = RequestRecord(
                    index=i - load.warmup,
                    group=req.group,
                    num_images=req.num_images,
                    text_tokens_est=req.text_tokens,
                    max_completion_tokens=req.max_completion_tokens,
                    scheduled_s=scheduled,
                )
                await stream_chat(
                    client, url, bodies[i], rec, t0, headers=headers, timeout_s=load.timeout_s, keep_text=keep_text
                )
            phase.done(rec)
            return rec

        warmup_records: list[RequestRecord] = []
        if load.warmup:
            with tqdm(total=load.warmup, desc="warm-up", unit="req", disable=not show_progress, leave=False) as bar:
                t0, phase = time.perf_counter(), _Phase(bar)
                sends = (send(i, t0, 0.0, None, phase) for i in range(load.warmup))
                warmup_records = list(await asyncio.gather(*sends))
            if all(not r.success for r in warmup_records):
                top = Counter(r.error for r in warmup_records).most_common(1)[0][0]
                raise BenchmarkError(f"all {load.warmup} warm-up requests failed, e.g. {top}")

        if before_measured is not None:
            before_measured()
        n = len(bodies) - load.warmup
        offsets = arrival_offsets(n, load.request_rate, load.burstiness, load.seed)
        lag: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe_loop_lag(lag, stop))
        with tqdm(total=n, desc="requests", unit="req", disable=not show_progress) as bar:
            t0, phase = time.perf_counter(), _Phase(bar)
            deadline = t0 + load.duration_s if load.duration_s else None
            tasks = []
            for k, offset in enumerate(offsets.tolist()):
                if deadline is not None and t0 + offset >= deadline:
                    break
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(load.warmup + k, t0, offset, deadline, phase)))
            done = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
        stop.set()
        await probe
    records = [r for r in done if r is not None]
    not_issued = n - len(records)
    return RunResult(records, warmup_records, duration, not_issued, "duration" if not_issued else "num_prompts", lag)


async def _probe_loop_lag(out: list[float], stop: asyncio.Event) -> None:
    """Every ``LOOP_LAG_INTERVAL_S``, append how long a just-readied task waits for its turn (seconds).

    A stream chunk's timestamp is taken when its task runs, so this wait is how much a busy client adds to
    each measured latency. It is measured with ``sleep(0)`` (one pass through the ready queue), not by how
    late a timed sleep wakes, which would mostly measure epoll's millisecond timer granularity.
    """
    while not stop.is_set():
        await asyncio.sleep(LOOP_LAG_INTERVAL_S)
        t = time.perf_counter()
        await asyncio.sleep(0)
        out.append(time.perf_counter() - t)
