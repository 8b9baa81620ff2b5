"""How long a stage keeps its device busy: the ``device_busy_seconds_total`` metric behind ``epdserve bench``'s
per-stage busy share (issue 45: which stage limits a GPU that several stages share).

On CUDA each measured piece of work (a prefill or decode forward, graphed or not) is bracketed by two timing
events on the current stream; the time between them, read once both have completed (never waiting for them), is
the work's device time, including any time the GPU spent on another process's work in between (time-slicing),
since that is time the stage holds the GPU waiting. On the CPU it is the call's wall time.

With ``EPDSERVE_DEVICE_TIMELINE_DIR`` set, each process also writes every block's start and end (unix seconds) to
``<dir>/<stage>-<pid>.jsonl`` (:class:`DeviceTimeline`): the stages' device work side by side in time, for
``python -m epdserve.bench.device_timeline DIR`` (issue 45: how the stages sharing one GPU overlap or wait).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


TIMELINE_ENV = "EPDSERVE_DEVICE_TIMELINE_DIR"


class DeviceTimeline:
    """One process's device blocks as JSON lines ``{"stage", "pid", "start", "end", "rows", "tokens"}`` (unix
    seconds; ``rows``: requests, ``tokens``: new tokens or patches, 0 when unknown), appended to
    ``<directory>/<stage>-<pid>.jsonl`` and flushed per line (a killed server keeps what it wrote).

    Raises:
        OSError: the directory cannot be created or the file opened.
    """

    def __init__(self, directory: str, stage: str):
        os.makedirs(directory, exist_ok=True)
        self.stage, self.pid = stage, os.getpid()
        self.path = os.path.join(directory, f"{stage}-{self.pid}.jsonl")
        self._file = open(self.path, "a", buffering=1)

    @classmethod
    def from_env(cls, stage: str) -> DeviceTimeline | None:
        """The timeline under :data:`TIMELINE_ENV`'s directory, or None when it is not set."""
        directory = os.environ.get(TIMELINE_ENV)
        return cls(directory, stage) if directory else None

    def add(self, start: float, end: float, rows: int = 0, tokens: int = 0) -> None:
        """One block: device busy from ``start`` to ``end`` (unix seconds)."""
        self._file.write(json.dumps({"stage": self.stage, "pid": self.pid, "start": round(start, 6),
                                     "end": round(end, 6), "rows": rows, "tokens": tokens}) + "\n")


class DeviceBusy:
    """Adds the device seconds of each :meth:`measure` block to ``add`` (a Prometheus counter's ``inc``).

    Args:
        device: where the measured work runs.
        add: called with seconds (float) once a block's device time is known: at once on the CPU; on CUDA from a
            later :meth:`measure` or :meth:`harvest`, when the block's end event has completed.
        timeline: where each block's start and end go too (None: nowhere). On CUDA they are placed in unix time
            through one anchor event that the first block waits for (the only wait this class makes).
    """

    def __init__(self, device: torch.device, add: Callable[[float], Any], timeline: DeviceTimeline | None = None):
        self.device, self.add, self.timeline = torch.device(device), add, timeline
        self._pending: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = collections.deque()
        self._anchor: tuple[torch.cuda.Event, float] | None = None  # an event and the unix time it completed at

    @contextlib.contextmanager
    def measure(self, rows: int = 0, tokens: int = 0) -> Iterator[None]:
        """Time the work queued inside the block (on CUDA: what the current stream runs between its edges);
        ``rows`` and ``tokens`` describe it on the timeline."""
        if self.device.type != "cuda":
            t0, unix0 = time.perf_counter(), time.time()
            try:
                yield
            finally:
                self.add(seconds := time.perf_counter() - t0)
                if self.timeline is not None:
                    self.timeline.add(unix0, unix0 + seconds, rows, tokens)
            return
        if torch.cuda.is_current_stream_capturing():  # a graph capture: no work runs, no event may be recorded
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        if self.timeline is not None and self._anchor is None:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(stream)
            anchor.synchronize()
            self._anchor = anchor, time.time()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._pending.append((start, end, rows, tokens))
            self.harvest()

    def harvest(self) -> None:
        """Add the device time of every block whose work has finished (oldest first; stops at the first that has
        not: one stream's work finishes in order)."""
        while self._pending and self._pending[0][1].query():
            start, end, rows, tokens = self._pending.popleft()
            self.add(start.elapsed_time(end) / 1000.0)
            if self.timeline is not None:
                anchor, unix = self._anchor
                t0 = unix + anchor.elapsed_time(start) / 1000.0
                self.timeline.add(t0, t0 + start.elapsed_time(end) / 1000.0, rows, tokens)


def track_device_busy(runner: Any, add: Callable[[float], Any], stage: str = "") -> None:
    """Measure every forward of ``runner`` (a ModelRunner, or a TPRunner: its rank-0 ModelRunner) into ``add``, and
    onto ``stage``'s :class:`DeviceTimeline` when :data:`TIMELINE_ENV` is set."""
    local = getattr(runner, "local", runner)
    local.busy = DeviceBusy(local.device, add, DeviceTimeline.from_env(stage) if stage else None)
