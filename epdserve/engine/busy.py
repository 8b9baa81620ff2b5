"""How long a stage keeps its device busy: the ``device_busy_seconds_total`` metric behind ``epdserve bench``'s
per-stage busy share (issue 45: which stage limits a GPU that several stages share).

On CUDA each measured piece of work (a prefill or decode forward, graphed or not) is bracketed by two timing
events on the current stream; the time between them, read once both have completed (never waiting for them), is
the work's device time, including any time the GPU spent on another process's work in between (time-slicing),
since that is time the stage holds the GPU waiting. On the CPU it is the call's wall time.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class DeviceBusy:
    """Adds the device seconds of each :meth:`measure` block to ``add`` (a Prometheus counter's ``inc``).

    Args:
        device: where the measured work runs.
        add: called with seconds (float) once a block's device time is known: at once on the CPU; on CUDA from a
            later :meth:`measure` or :meth:`harvest`, when the block's end event has completed.
    """

    def __init__(self, device: torch.device, add: Callable[[float], Any]):
        self.device, self.add = torch.device(device), add
        self._pending: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event]] = collections.deque()

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Time the work queued inside the block (on CUDA: what the current stream runs between its edges)."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.add(time.perf_counter() - t0)
            return
        if torch.cuda.is_current_stream_capturing():  # a graph capture: no work runs, no event may be recorded
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._pending.append((start, end))
            self.harvest()

    def harvest(self) -> None:
        """Add the device time of every block whose work has finished (oldest first; stops at the first that has
        not: one stream's work finishes in order)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self.add(start.elapsed_time(end) / 1000.0)


def track_device_busy(runner: Any, add: Callable[[float], Any]) -> None:
    """Measure every forward of ``runner`` (a ModelRunner, or a TPRunner: its rank-0 ModelRunner) into ``add``."""
    local = getattr(runner, "local", runner)
    local.busy = DeviceBusy(local.device, add)
