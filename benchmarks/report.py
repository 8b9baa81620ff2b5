"""Human and machine output: the ``vllm bench serve``-style summary table, the sweep table, the JSON file."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .runner import RunResult

SCHEMA = "epdserve.bench/1"
SWEEP_SCHEMA = "epdserve.bench.sweep/1"
_WIDTH = 50

_LATENCY_SECTIONS = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2e_ms", "E2E", "End-to-end Latency"),
)


def _rule(title: str = "", fill: str = "-") -> str:
    return f"{(' ' + title + ' ') if title else '':{fill}^{_WIDTH}}"


def _row(label: str, value: Any, fmt: str = ".2f") -> str:
    text = "n/a" if value is None else (format(value, fmt) if isinstance(value, float) else str(value))
    return f"{label + ':':<40} {text:<10}"


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The summary table: counts and throughputs, then mean/median/p90/p99 of TTFT, TPOT, ITL and E2E (ms),
    goodput when SLOs were given, the client's overhead, failures grouped by message, and warnings."""
    rows = [
        _rule(title, "="),
        _row("Successful requests", s["successful_requests"]),
        _row("Failed requests", s["failed_requests"]),
    ]
    if s["not_issued_requests"]:
        rows.append(_row("Not issued (--duration reached)", s["not_issued_requests"]))
    rows += [
        _row("Request rate configured (req/s)", s["request_rate"]),
        _row("Maximum request concurrency", s["max_concurrency"] or "unlimited"),
        _row("Benchmark duration (s)", s["duration_s"]),
        _row("Total input tokens", s["total_input_tokens"]),
        _row("Total generated tokens", s["total_output_tokens"]),
        _row("Total cached input tokens", s["total_cached_tokens"]),
        _row("Cached share of input tokens (%)", 100.0 * s["cached_token_share"]),
        _row("Request throughput (req/s)", s["request_throughput_rps"]),
    ]
    if s["slo_ms"]:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo_ms"].items())
        rows += [_row("Request goodput (req/s)", s["goodput_rps"]), _row("Goodput SLO", slo)]
    rows += [
        _row("Input token throughput (tok/s)", s["input_token_throughput_tps"]),
        _row("Output token throughput (tok/s)", s["output_token_throughput_tps"]),
        _row("Total token throughput (tok/s)", s["total_token_throughput_tps"]),
        _row("Peak output token throughput (tok/s)", s["peak_output_throughput_tps"]),
        _row("Peak concurrent requests", s["peak_concurrent_requests"]),
    ]
    for key, short, title_ in _LATENCY_SECTIONS:
        st = s[key]
        rows.append(_rule(title_))
        rows += [_row(f"{name} {short} (ms)", st[k]) for name, k in
                 (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))]
    c = s["client"]
    rows += [
        _rule("Client Overhead"),
        _row("Bookkeeping per stream event (us)", c["overhead_per_event_us"]),
        _row("Event-loop lag mean (ms)", c["loop_lag_ms"]["mean"], ".3f"),
        _row("Event-loop lag P99 (ms)", c["loop_lag_ms"]["p99"], ".3f"),
    ]
    if s["errors"]:
        rows.append(_rule("Failed Requests by Error"))
        rows += [f"{n:>6}  {msg}" for msg, n in s["errors"].items()]
    rows.append("=" * _WIDTH)
    rows += [f"warning: {w}" for w in s["warnings"]]
    return "\n".join(rows)


def text_table(columns: Sequence[tuple[str, int, Callable[[Any], str]]], rows: Iterable[Any]) -> str:
    """A plain-text table: per column ``(header, width, cell)``, ``cell(row)`` giving the text of that row's
    cell; headers and cells right-aligned to the column's width, columns one space apart, a rule under the header
    (the layout of ``vllm bench``'s sweep tables)."""
    head = " ".join(f"{name:>{width}}" for name, width, _ in columns)
    lines = [head, "-" * len(head)]
    lines += [" ".join(f"{cell(row):>{width}}" for _, width, cell in columns) for row in rows]
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_sweep(runs: list[dict[str, Any]]) -> str:
    """One line per request rate: counts, throughputs and the main latency figures (ms)."""
    return text_table([
        ("rate", 6, lambda s: str(s["request_rate"])),
        ("ok", 5, lambda s: str(s["successful_requests"])),
        ("fail", 5, lambda s: str(s["failed_requests"])),
        ("req/s", 7, lambda s: f"{s['request_throughput_rps']:.2f}"),
        ("out tok/s", 10, lambda s: f"{s['output_token_throughput_tps']:.1f}"),
        ("TTFT mean", 10, lambda s: _ms(s["ttft_ms"]["mean"])),
        ("TTFT p99", 9, lambda s: _ms(s["ttft_ms"]["p99"])),
        ("TPOT mean", 10, lambda s: _ms(s["tpot_ms"]["mean"])),
        ("TPOT p99", 9, lambda s: _ms(s["tpot_ms"]["p99"])),
        ("ITL mean", 9, lambda s: _ms(s["itl_ms"]["mean"])),
        ("E2E mean", 9, lambda s: _ms(s["e2e_ms"]["mean"])),
    ], (run["summary"] for run in runs))


def run_payload(config: dict[str, Any], summary: dict[str, Any], result: RunResult) -> dict[str, Any]:
    """The JSON document of one run (schema ``epdserve.bench/1``, see README.md)."""
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "summary": summary,
        "requests": [dataclasses.asdict(r) for r in result.records],
        "warmup_requests": [dataclasses.asdict(r) for r in result.warmup_records],
    }


def sweep_payload(config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON document of a sweep (schema ``epdserve.bench.sweep/1``): one run document per rate."""
    return {
        "schema": SWEEP_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "runs": runs,
    }


def print_rows(table: str, rows: list[dict], args: Any) -> None:
    """A table-style benchmark's ending (bench.encoder, bench.gateway, bench.step): print ``table``, and write
    ``{"config": vars(args), "results": rows}`` to ``args.output_json`` when given."""
    print(table)
    if args.output_json:
        write_json(args.output_json, {"config": vars(args), "results": rows})


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
