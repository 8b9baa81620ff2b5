"""From per-request records to the run's summary: throughputs, latency percentiles, goodput, errors, a timeline
and the client's own overhead.

Records hold seconds; the summary reports latencies in milliseconds (keys ending ``_ms``), throughputs per
second, and the timeline in seconds.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from .client import RequestRecord
from .runner import LoadConfig, RunResult

SLO_METRICS = ("ttft", "tpot", "e2e")
# Timeline bin widths to choose from (seconds): the smallest that keeps a run within _MAX_BINS bins.
_BIN_CHOICES_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
_MAX_BINS = 120
# The client's share of a measured gap above which the summary warns that its numbers may be inflated.
_OVERHEAD_WARN_SHARE = 0.01
_LAG_WARN_SHARE = 0.10
_CACHED_WARN_SHARE = 0.5  # above this, a run mostly measured prefix-cache hits


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds). Keys: ttft, tpot, e2e."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"SLO must look like ttft=MS,tpot=MS,e2e=MS; got {item!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"SLO value for {key} must be milliseconds, got {value!r}") from None
    return out


def stats_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """Mean, median, p90, p99, std, min, max of ``values_s`` (seconds) in milliseconds, plus ``count``."""
    keys = ("mean", "median", "p90", "p99", "std", "min", "max")
    if not values_s:
        return {"count": 0, **dict.fromkeys(keys)}
    a = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    vals = (a.mean(), p50, p90, p99, a.std(), a.min(), a.max())
    return {"count": int(a.size), **{k: float(v) for k, v in zip(keys, vals)}}


def meets_slo(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """A successful request within every given SLO (a one-token answer has no TPOT and passes that one)."""
    if not r.success:
        return False
    measured = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    return all(measured[k] is None or measured[k] * 1000.0 <= limit for k, limit in slo_ms.items())


def summarize(result: RunResult, load: LoadConfig, slo_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's summary dict (the ``summary`` object of the JSON output; README.md documents each key)."""
    ok = [r for r in result.records if r.success]
    dur = result.duration_s
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    inp = sum(r.prompt_tokens or 0 for r in ok)
    out = sum(r.completion_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    itl = [g for r in ok for g in r.itl_s]
    tl = timeline(result.records, dur)
    summary: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(result.records) - len(ok),
        "not_issued_requests": result.not_issued,
        "stopped_by": result.stopped_by,
        "warmup_requests": len(result.warmup_records),
        "warmup_failed_requests": sum(not r.success for r in result.warmup_records),
        "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "duration_s": dur,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "total_cached_tokens": cached,
        "cached_token_share": cached / inp if inp else 0.0,
        "request_throughput_rps": per_s(len(ok)),
        "input_token_throughput_tps": per_s(inp),
        "output_token_throughput_tps": per_s(out),
        "total_token_throughput_tps": per_s(inp + out),
        "peak_output_throughput_tps": max(tl["output_tokens_per_s"], default=0.0),
        "peak_concurrent_requests": peak_concurrency(result.records),
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": stats_ms(itl),
        "e2e_ms": stats_ms([r.e2e_s for r in ok]),
        "slo_ms": slo_ms or None,
        "good_requests": None,
        "goodput_rps": None,
        "errors": dict(Counter(r.error for r in result.records if not r.success).most_common()),
        "warmup_errors": dict(Counter(r.error for r in result.warmup_records if not r.success).most_common()),
        "client": client_overhead(result, itl),
        "timeline": tl,
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in ok)
        summary["good_requests"], summary["goodput_rps"] = good, per_s(good)
    summary["warnings"] = _warnings(summary, ok)
    return summary


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at one instant (from send to the end of the stream)."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])  # ends sort first
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def timeline(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Per-bin series over the run: output tokens/s, completed requests/s and mean requests in flight.

    A request's ``completion_tokens`` are spread evenly over its token chunks (exact when the server streams
    one token per chunk). ``t_s`` holds each bin's start in seconds.
    """
    bin_s = next((b for b in _BIN_CHOICES_S if duration_s / b <= _MAX_BINS), _BIN_CHOICES_S[-1])
    nbins = max(1, math.ceil(duration_s / bin_s))
    edges = np.arange(nbins + 1) * bin_s
    tokens, done, busy = np.zeros(nbins), np.zeros(nbins), np.zeros(nbins)
    for r in records:
        if r.success:
            times = r.chunk_times_s() or [r.end_s]
            w = (r.completion_tokens or 0) / len(times)
            tokens += np.histogram(np.clip(times, 0, edges[-1] - 1e-9), bins=edges, weights=[w] * len(times))[0]
            done[min(nbins - 1, int(r.end_s / bin_s))] += 1
        # Seconds of each bin this request was in flight.
        busy += np.clip(np.minimum(edges[1:], r.end_s) - np.maximum(edges[:-1], r.start_s), 0, None)
    return {
        "bin_s": bin_s,
        "t_s": np.round(edges[:-1], 6).tolist(),
        "output_tokens_per_s": (tokens / bin_s).tolist(),
        "completed_requests_per_s": (done / bin_s).tolist(),
        "in_flight_mean": (busy / bin_s).tolist(),
    }


def client_overhead(result: RunResult, itl_s: list[float]) -> dict[str, Any]:
    """The client's own cost: bookkeeping time per stream event (parse, timestamps; microseconds) and how long
    a task that became ready waited for the client's event loop (milliseconds, sampled every 10 ms). Both
    delay every timestamp the client takes; both are compared to the mean ITL."""
    events = sum(r.num_events for r in result.records)
    spent = sum(r.client_overhead_s for r in result.records)
    per_event = spent / events if events else 0.0
    per_request = [r.client_overhead_s / r.num_events for r in result.records if r.num_events]
    mean_itl = float(np.mean(itl_s)) if itl_s else None
    return {
        "overhead_per_event_us": per_event * 1e6,
        "overhead_per_event_us_worst_request": max(per_request, default=0.0) * 1e6,
        "overhead_share_of_mean_itl": per_event / mean_itl if mean_itl else None,
        "total_events": events,
        "loop_lag_ms": stats_ms(result.loop_lag_s),
    }


def _warnings(s: dict[str, Any], ok: list[RequestRecord]) -> list[str]:
    out = []
    c, itl = s["client"], s["itl_ms"]["mean"]
    if itl and c["overhead_per_event_us"] / 1000.0 > _OVERHEAD_WARN_SHARE * itl:
        out.append(f"client bookkeeping per chunk ({c['overhead_per_event_us']:.0f} us) exceeds "
                   f"{_OVERHEAD_WARN_SHARE:.0%} of the mean ITL; measured latencies may include client time")
    lag = c["loop_lag_ms"]["p99"]
    if itl and lag is not None and lag > _LAG_WARN_SHARE * itl:
        out.append(f"client event-loop lag p99 ({lag:.2f} ms) exceeds {_LAG_WARN_SHARE:.0%} of the mean ITL; "
                   "the client may be saturated (fewer concurrent requests or a faster machine)")
    if any(not r.usage_reported for r in ok):
        out.append("some responses had no usage: their token counts are chunk counts and text estimates")
    short = sum(r.completion_tokens is not None and r.completion_tokens != r.max_completion_tokens for r in ok)
    if short:
        out.append(f"{short} requests returned a different number of output tokens than asked "
                   "(the server may not honour ignore_eos)")
    if s["cached_token_share"] > _CACHED_WARN_SHARE:
        out.append(f"{s['cached_token_share']:.0%} of the prompt tokens came from the server's prefix cache: a run "
                   "that repeats an earlier --seed against the same server repeats its prompts and images, and "
                   "measures cached requests")
    if s["stopped_by"] == "duration":
        out.append(f"--duration reached: {s['not_issued_requests']} requests were not issued")
    return out
