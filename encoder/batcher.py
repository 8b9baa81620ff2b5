"""Cross-request batching for the vision tower: images from concurrent requests share one processor + tower call.

Requests hand decoded images to :meth:`EncodeBatcher.submit` and await a future. One runner task takes the
oldest pending images, up to a budget in patches, as one batch: ONE image-processor call
(``VisionEncoder.preprocess``) on a preprocessing thread, then ONE tower call (``VisionEncoder.run_tower``: one
forward over the concatenated ``pixel_values`` with one ``image_grid_thw`` row per image, one device-to-host
copy) on the tower thread, then each image's future gets its own rows. The two stages form a pipeline of depth
two: the next batch is preprocessed while the tower runs this one, which hides the processor's host time (tens
of ms for 16 images) behind the tower's GPU time. While a batch is on the tower, new images queue for the next
one (continuous batching, as in Orca, Yu et al., OSDI 2022). While the tower is idle, the runner waits for the
batching window only for images already on their way (:meth:`EncodeBatcher.announce`: being decoded for a
request that arrived): a lone request never waits for company that is not coming.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from PIL import Image

from epdserve.encoder.metrics import EncoderMetrics
from epdserve.engine.busy import DeviceTimeline


class ImageEncoder(Protocol):
    """What the batcher needs of :class:`epdserve.encoder.vision.VisionEncoder`: ``run_tower(preprocess(x))``
    is the encoding of images ``x``; the two may run at once on two threads. Only items of the same encoder object
    share a call, so a :class:`~epdserve.encoder.video.VideoJob` (one per video, ``is_video`` true for the
    metrics) runs alone."""

    def preprocess(self, images: list[Image.Image]) -> Any: ...

    def run_tower(self, prepared: Any) -> list[tuple[torch.Tensor, list[int]]]: ...


@dataclass
class _Pending:
    encoder: ImageEncoder
    image: Image.Image
    patches: int
    arrival: float  # loop.time() at submit, in seconds
    future: asyncio.Future


class EncodeBatcher:
    """Batches images across requests for one tower executor (a single thread: one tower call at a time) and
    its own preprocessing thread.

    Use it from one event loop. Each image's outcome is its own future: a tower failure fails every image of
    that batch with the tower's exception; an image whose waiter was cancelled is dropped from the batch.

    Attributes:
        calls: tower calls made so far (one per batch).
    """

    def __init__(self, tower: Executor, batch_wait_ms: float = 2.0, max_batch_patches: int = 65536,
                 metrics: EncoderMetrics | None = None) -> None:
        """Args:
            tower: the executor ``encode`` runs on (single-threaded: VisionEncoder is not thread-safe).
            batch_wait_ms: how long the oldest pending image may wait, while the tower is idle, for announced
                images (:meth:`announce`), in milliseconds; 0 runs a batch as soon as the tower is free.
            max_batch_patches: budget of one batch in patches before the spatial merge (an image's ``t*h*w``);
                an image larger than the budget runs alone.
            metrics: where each tower call is recorded (batch size, queue times, duration); optional.

        Raises:
            ValueError: ``batch_wait_ms < 0`` or ``max_batch_patches < 1``.
        """
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
        if max_batch_patches < 1:
            raise ValueError(f"max_batch_patches must be >= 1, got {max_batch_patches}")
        self._tower = tower
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epdserve-vision-prep")
        self._tower_task: asyncio.Task | None = None  # the latest batch's tower stage
        self._tower_started = 0.0  # loop.time() when the latest tower call started
        self._prep_s = self._tower_s = 0.0  # moving averages of the two stages' durations, in seconds
        self._wait_s = batch_wait_ms / 1000
        self._max_patches = max_batch_patches
        self._queue: list[_Pending] = []
        self._queued_patches = 0
        self._full = asyncio.Event()  # the queue holds a whole budget: stop waiting for the window
        self._announced = 0  # images announced and not yet submitted (or withdrawn)
        self._settled = asyncio.Event()  # set when the last announced image arrived: stop waiting for the window
        self._runner: asyncio.Task | None = None
        self.calls = 0
        self._metrics = metrics
        self._timeline = DeviceTimeline.from_env("encoder")  # the tower calls' times, when asked for

    @property
    def queued(self) -> int:
        """Images waiting for a tower call now."""
        return len(self._queue)

    def announce(self) -> None:
        """Say that one image will be submitted soon (it is being decoded), so a batch about to start waits for
        it up to the batching window. Each call is followed by one ``submit(..., announced=True)`` or one
        :meth:`withdraw`; must be called on the loop."""
        self._announced += 1

    def withdraw(self) -> None:
        """An announced image will not come (its decode failed or its request was cancelled)."""
        self._arrived()

    def _arrived(self) -> None:
        self._announced -= 1
        if self._announced == 0:
            self._settled.set()

    def submit(self, encoder: ImageEncoder, image: Image.Image, patches: int,
               announced: bool = False) -> asyncio.Future:
        """Queue ``image`` (``patches`` = its ``t*h*w`` grid size) for ``encoder``; must be called on the loop.
        ``announced``: this is the image of an earlier :meth:`announce`.

        Returns:
            A future of ``(embedding, grid_thw)`` exactly as ``encoder.encode([image])[0]`` would give; it fails
            with the tower's exception if its batch fails. Cancelling it drops the image if not yet running.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if announced:
            self._arrived()
        self._queue.append(_Pending(encoder, image, patches, loop.time(), fut))
        self._queued_patches += patches
        if self._queued_patches >= self._max_patches:
            self._full.set()
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())
        return fut

    def _take(self) -> list[_Pending]:
        """Pending images for one call: the oldest, then every later one that still fits the budget and shares
        its encoder (first fit, so a large image waiting does not hold smaller ones back; it heads the next
        batch). Drops images whose waiter was cancelled."""
        self._queue = [item for item in self._queue if not item.future.done()]
        batch: list[_Pending] = []
        rest: list[_Pending] = []
        patches = 0
        for item in self._queue:
            if not batch or (patches + item.patches <= self._max_patches and item.encoder is batch[0].encoder):
                batch.append(item)
                patches += item.patches
            else:
                rest.append(item)
        self._queue = rest
        self._queued_patches = sum(item.patches for item in rest)
        if self._queued_patches < self._max_patches:
            self._full.clear()
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[_Pending] = []
        try:
            while self._queue:
                # The window holds a batch back only for images already being decoded.
                delay = self._queue[0].arrival + self._wait_s - loop.time() if self._announced else 0.0
                tower = self._busy_tower()
                if tower is not None:
                    # Take the next batch only when its preprocessing would end as the tower's call does: the
                    # images that arrive until then still join it, where taking it at once would make it small.
                    delay = max(delay, self._tower_started + self._tower_s - self._prep_s - loop.time())
                if delay > 0 and not self._full.is_set():
                    # The wait ends early when the budget fills up, the tower frees up, or (tower idle) the last
                    # announced image arrives.
                    self._settled.clear()
                    wakers = [asyncio.ensure_future(self._full.wait())]
                    if tower is None:
                        wakers.append(asyncio.ensure_future(self._settled.wait()))
                    try:
                        await asyncio.wait([*wakers, *([tower] if tower else [])], timeout=delay,
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for w in wakers:
                            w.cancel()
                    continue
                batch = self._take()
                if not batch:
                    continue
                self.calls += 1
                started = loop.time()
                try:
                    prepared = await loop.run_in_executor(self._prep, batch[0].encoder.preprocess,
                                                          [item.image for item in batch])
                except Exception as e:  # each waiting request logs and reports it
                    _fail(batch, e)
                    batch = []
                    continue
                prep_s = loop.time() - started
                self._prep_s = _ema(self._prep_s, prep_s)
                # At most one batch waits for the tower beyond the one on it: images arriving meanwhile
                # queue and form a larger next batch instead of many small ones.
                if (tower := self._busy_tower()) is not None:
                    await asyncio.wait([tower])
                self._tower_started = loop.time()  # the tower thread is free: the call starts now
                self._tower_task = asyncio.create_task(self._tower_stage(batch, prepared, started, prep_s))
                batch = []
        finally:
            # Reached at the end of the queue, or on cancellation (aclose): nothing may be left waiting.
            self._runner = None
            _fail(batch + self._queue, RuntimeError("encoding was cancelled (server stopping)"))
            self._queue.clear()
            self._queued_patches = 0

    def _busy_tower(self) -> asyncio.Task | None:
        """The latest batch's tower stage while it still runs, else None."""
        task = self._tower_task
        return task if task is not None and not task.done() else None

    async def _tower_stage(self, batch: list[_Pending], prepared: Any, started: float, prep_s: float) -> None:
        """Run ``prepared`` on the tower and resolve ``batch``'s futures; metrics: queue time until ``started``
        (its preprocessing began), encode time = preprocessing (``prep_s``) + tower, without the wait between."""
        loop = asyncio.get_running_loop()
        tower_started = loop.time()
        try:
            outs = await loop.run_in_executor(self._tower, batch[0].encoder.run_tower, prepared)
            if len(outs) != len(batch):
                raise RuntimeError(f"encoder returned {len(outs)} results for {len(batch)} images")
        except asyncio.CancelledError:
            _fail(batch, RuntimeError("encoding was cancelled (server stopping)"))
            raise
        except Exception as e:  # each waiting request logs and reports it
            _fail(batch, e)
            return
        tower_s = loop.time() - tower_started
        if self._timeline is not None:
            now = time.time()
            self._timeline.add(now - tower_s, now, len(batch), sum(item.patches for item in batch))
        self._tower_s = _ema(self._tower_s, tower_s)
        for item, out in zip(batch, outs):
            if not item.future.done():
                item.future.set_result(out)
        if self._metrics is not None:
            self._metrics.device_busy.inc(tower_s)  # the tower call returns its results: its wall time is the GPU's
            self._metrics.on_batch([started - item.arrival for item in batch], sum(item.patches for item in batch),
                                   prep_s + tower_s,
                                   video=getattr(batch[0].encoder, "is_video", False))

    async def aclose(self) -> None:
        """Stop the runner; images queued, being preprocessed or on the tower fail with RuntimeError (the running
        tower call finishes in its thread)."""
        tasks = [t for t in (self._runner, self._tower_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._prep.shutdown(wait=False, cancel_futures=True)


def _ema(average: float, sample: float) -> float:
    return sample if average == 0.0 else 0.5 * average + 0.5 * sample


def _fail(items: list[_Pending], error: BaseException) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)
