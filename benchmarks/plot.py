"""PNG plots of a run (latency distributions, throughput over time) and of a sweep (latency vs throughput).

Figures are built with ``matplotlib.figure.Figure`` and rendered by the Agg canvas directly, never through
``pyplot``: no global figure registry, no GUI backend, safe in threads and on headless machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .client import RequestRecord


def _hist(ax, values_ms: list[float], title: str, color: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values_ms, bins=min(60, max(10, len(values_ms) // 4)), color=color, alpha=0.8)
    for q, style in ((50, "-"), (99, "--")):
        v = float(np.percentile(values_ms, q))  # the same interpolation as the summary table
        ax.axvline(v, color="black", linestyle=style, linewidth=1, label=f"p{q} {v:.1f}")
    ax.legend(fontsize=8)


def _save(fig: Figure, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)


def plot_run(summary: dict[str, Any], records: list[RequestRecord], path: str | Path, title: str = "") -> None:
    """Write a 2x2 PNG: TTFT, TPOT and ITL histograms (ms) and output tokens/s with requests in flight over
    time (s)."""
    ok = [r for r in records if r.success]
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    _hist(axes[0, 0], [r.ttft_s * 1e3 for r in ok], "TTFT", "tab:blue")
    _hist(axes[0, 1], [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None], "TPOT", "tab:orange")
    _hist(axes[1, 0], [g * 1e3 for r in ok for g in r.itl_s], "ITL", "tab:green")
    tl, ax = summary["timeline"], axes[1, 1]
    ax.set_title(f"Throughput over time (bins of {tl['bin_s']:g} s)")
    ax.step(tl["t_s"], tl["output_tokens_per_s"], where="post", color="tab:purple", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    twin = ax.twinx()
    twin.step(tl["t_s"], tl["in_flight_mean"], where="post", color="tab:gray", alpha=0.7, label="in flight")
    twin.set_ylabel("requests in flight (mean)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper right")
    n_ok, n_fail = summary["successful_requests"], summary["failed_requests"]
    fig.suptitle(f"{title}  ({n_ok} ok, {n_fail} failed, {summary['request_throughput_rps']:.2f} req/s)".strip())
    _save(fig, path)


def plot_sweep(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Write a 1x3 PNG: mean and p99 of TTFT, TPOT and E2E latency (ms) against output token throughput
    (tok/s), one point per request rate, each labelled with its rate."""
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    axes = fig.subplots(1, 3)
    xs = [run["summary"]["output_token_throughput_tps"] for run in runs]
    rates = [run["summary"]["request_rate"] for run in runs]
    rates = [format(r, "g") if isinstance(r, float) else str(r) for r in rates]  # 2.0 -> "2", "inf" stays
    for ax, (key, name) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency"))):
        for stat, style in (("mean", "o-"), ("p99", "s--")):
            ys = [run["summary"][key][stat] for run in runs]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=stat)
        for x, y, rate in zip(xs, (run["summary"][key]["mean"] for run in runs), rates):
            if y is not None:
                ax.annotate(f"{rate}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(f"{name} vs throughput")
        ax.set_xlabel("output token throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Latency vs throughput across request rates")
    _save(fig, path)
