"""Where a request's time goes, from a ``--log-level DEBUG`` text log: ``python -m epdserve.bench.timeline LOG``.

Every stage logs ``rid=<id> <event>`` lines (``epdserve.logging_setup``); ``epdserve launch`` writes all stages
into one stream. For each request this orders its events by time and takes the gap between each consecutive
pair; the report is the median and p90 of every ``event -> next event`` gap over all requests, in the order the
events usually happen. Event names are the messages with numbers and hashes replaced by ``N`` / ``H``, so
``prefilled 530 tokens (0 cached)`` from any request counts as the same event. Timestamps are the text
format's milliseconds, so gaps under ~2 ms are noise.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_RID = re.compile(r"\brid=([A-Za-z0-9._:\-]+)\s*")
_HASH = re.compile(r"\b[0-9a-f]{8,}\b")
_NUM = re.compile(r"\b\d+(\.\d+)?\b")


def events(lines: Iterable[str]) -> dict[str, list[tuple[int, str]]]:
    """``{rid: [(unix time in ms, event name), ...]}`` in log order, from text-format log lines (others skipped)."""
    out: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for line in lines:
        m = _LINE.match(line.rstrip("\n"))
        if not m or not (r := _RID.search(m.group(2))):
            continue
        t = round(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1e3)
        name = _NUM.sub("N", _HASH.sub("H", _RID.sub("", m.group(2)))).strip()
        out[r.group(1)].append((t, name))
    return out


def gaps(by_rid: dict[str, list[tuple[int, str]]]) -> list[tuple[str, str, list[float], float]]:
    """Every ``(event, next event, gaps in ms, mean position)`` over all requests, ordered by where the pair
    usually sits in a request's life (its mean index)."""
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    where: dict[tuple[str, str], list[int]] = defaultdict(list)
    for evs in by_rid.values():
        evs = sorted(evs, key=lambda e: e[0])  # stable: same-millisecond events keep log order
        for i, ((t0, a), (t1, b)) in enumerate(zip(evs, evs[1:])):
            pairs[a, b].append(float(t1 - t0))
            where[a, b].append(i)
    rows = [(a, b, ms, statistics.fmean(where[a, b])) for (a, b), ms in pairs.items()]
    return sorted(rows, key=lambda r: r[3])


def report(by_rid: dict[str, list[tuple[int, str]]], min_share: float = 0.05) -> str:
    """A text table of :func:`gaps`: pairs seen in fewer than ``min_share`` of the requests are left out."""
    n = len(by_rid)
    lines = [f"{n} requests", f"{'from -> to':<96} {'n':>5} {'median ms':>10} {'p90 ms':>8}"]
    for a, b, ms, _ in gaps(by_rid):
        if len(ms) < min_share * n:
            continue
        ms = sorted(ms)
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        lines.append(f"{(a + ' -> ' + b)[:96]:<96} {len(ms):>5} {statistics.median(ms):>10.1f} {p90:>8.1f}")
    whole = [float(max(e)[0] - min(e)[0]) for e in by_rid.values() if len(e) > 1]
    if whole:
        lines.append(f"{'first -> last event of a request':<96} {len(whole):>5} {statistics.median(whole):>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epdserve.bench.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="a text-format DEBUG log (.gz read as gzip)")
    p.add_argument("--min-share", type=float, default=0.05,
                   help="leave out event pairs seen in fewer than this share of the requests")
    args = p.parse_args(argv)
    opener = gzip.open if args.log.suffix == ".gz" else open
    with opener(args.log, "rt", errors="replace") as f:
        print(report(events(f), args.min_share))


if __name__ == "__main__":
    main()
