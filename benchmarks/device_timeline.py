"""The stages' device work side by side in time: ``python -m epdserve.bench.device_timeline DIR [--plot F.png]``.

Start the servers with ``EPDSERVE_DEVICE_TIMELINE_DIR=DIR`` in their environment (``epdserve launch`` passes it to
every stage), run a load, then point this at ``DIR``. Each process wrote one JSON line per block of device work
(:class:`epdserve.engine.busy.DeviceTimeline`): a prefill or decode forward (from CUDA events, so a block also
holds the time its kernels waited for another process's under time-slicing) or an encoder tower call (wall time).

Reported over the window (the first block's start to the last one's end, or ``--start``/``--end`` seconds into
it): each stage's busy share (the union of its blocks), how much of it another stage was busy at the same time
(under time-slicing the two then took turns; under MPS they ran together), the share of the window when no stage
was busy, and, for decode, the gaps between one step's end and the next one's start (a decode starved by the
others' work shows long gaps while it has requests). ``--plot`` draws the blocks as lanes, one per process
(matplotlib). Issue 45: where the time goes when three processes share one GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

STAGES = ("encoder", "prefill", "decode")


@dataclass(frozen=True)
class Block:
    """One block of a process's device work, in seconds from the window's start."""

    stage: str
    pid: int
    start: float
    end: float
    rows: int = 0
    tokens: int = 0


def load(directory: str | Path) -> list[Block]:
    """Every block of every ``*.jsonl`` under ``directory``, times relative to the earliest start, sorted by start.

    Raises:
        FileNotFoundError: no ``*.jsonl`` file there.
    """
    files = sorted(Path(directory).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl timeline files in {str(directory)!r}")
    raw = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                raw.append((d["stage"], int(d["pid"]), float(d["start"]), float(d["end"]), int(d.get("rows", 0)),
                            int(d.get("tokens", 0))))
    t0 = min(r[2] for r in raw) if raw else 0.0
    return sorted((Block(s, p, a - t0, b - t0, r, t) for s, p, a, b, r, t in raw), key=lambda b: b.start)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering exactly the union of ``intervals`` (``(start, end)``, any order)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return sum(b - a for a, b in intervals)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sets of disjoint, sorted intervals."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(blocks: list[Block], start: float, end: float) -> list[Block]:
    """The blocks' parts inside ``[start, end)``."""
    return [Block(b.stage, b.pid, max(b.start, start), min(b.end, end), b.rows, b.tokens) for b in blocks
            if b.end > start and b.start < end]


def summary(blocks: list[Block]) -> dict:
    """``{"window_s", "idle_share", "stages": {stage: {...}}}`` over the blocks' extent (see the module docstring):
    per stage ``blocks``, ``busy_s``, ``busy_share``, ``overlap_share`` (of its busy time, another stage busy too),
    ``block_ms_median``, ``rows_mean``; for decode ``gap_ms_median`` and ``gap_ms_p90`` between consecutive
    blocks of one process."""
    if not blocks:
        return {"window_s": 0.0, "idle_share": 0.0, "stages": {}}
    lo, hi = min(b.start for b in blocks), max(b.end for b in blocks)
    window = hi - lo
    busy = {s: union([(b.start, b.end) for b in blocks if b.stage == s]) for s in {b.stage for b in blocks}}
    everyone = union([iv for ivs in busy.values() for iv in ivs])
    stages = {}
    for s in [x for x in STAGES if x in busy] + sorted(set(busy) - set(STAGES)):
        mine = [b for b in blocks if b.stage == s]
        others = union([iv for t, ivs in busy.items() if t != s for iv in ivs])
        own = length(busy[s])
        row = {"blocks": len(mine), "busy_s": round(own, 4), "busy_share": round(own / window, 4) if window else 0.0,
               "overlap_share": round(length(intersect(busy[s], others)) / own, 4) if own else 0.0,
               "block_ms_median": round(statistics.median((b.end - b.start) * 1e3 for b in mine), 3),
               "rows_mean": round(statistics.fmean(b.rows for b in mine), 2)}
        if s == "decode":
            gaps = []
            by_pid: dict[int, list[Block]] = defaultdict(list)
            for b in mine:
                by_pid[b.pid].append(b)
            for seq in by_pid.values():
                gaps += [max(0.0, (b.start - a.end) * 1e3) for a, b in zip(seq, seq[1:])]
            if gaps:
                gaps.sort()
                row["gap_ms_median"] = round(statistics.median(gaps), 3)
                row["gap_ms_p90"] = round(gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))], 3)
        stages[s] = row
    return {"window_s": round(window, 4), "idle_share": round(1 - length(everyone) / window, 4) if window else 0.0,
            "stages": stages}


def plot(blocks: list[Block], path: str | Path) -> None:
    """The blocks as horizontal lanes, one per process (stage order, then pid), saved to ``path`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes = sorted({(b.stage, b.pid) for b in blocks},
                   key=lambda k: (STAGES.index(k[0]) if k[0] in STAGES else len(STAGES), k[1]))
    colors = {"encoder": "tab:green", "prefill": "tab:blue", "decode": "tab:orange"}
    fig = Figure(figsize=(14, 1 + 0.6 * len(lanes)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, (stage, pid) in enumerate(lanes):
        spans = [(b.start, b.end - b.start) for b in blocks if (b.stage, b.pid) == (stage, pid)]
        ax.broken_barh(spans, (y - 0.4, 0.8), color=colors.get(stage, "tab:gray"))
    ax.set_yticks(range(len(lanes)), [f"{s} {p}" for s, p in lanes])
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epdserve.bench.device_timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="the EPDSERVE_DEVICE_TIMELINE_DIR the servers wrote to")
    p.add_argument("--start", type=float, default=None, help="window start, seconds after the first block")
    p.add_argument("--end", type=float, default=None, help="window end, seconds after the first block")
    p.add_argument("--plot", default=None, help="draw the window's blocks to this PNG")
    p.add_argument("--output-json", default=None, help="write the summary here too")
    args = p.parse_args(argv)
    blocks = load(args.directory)
    if args.start is not None or args.end is not None:
        blocks = clip(blocks, args.start or 0.0, args.end if args.end is not None else float("inf"))
    result = summary(blocks)
    print(f"window {result['window_s']:.3f} s, no stage busy {result['idle_share']:.1%}")
    for stage, row in result["stages"].items():
        print(f"{stage:8s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    if args.plot:
        plot(blocks, args.plot)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
