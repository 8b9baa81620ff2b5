"""Cross-request batching for the vision tower: images from concurrent requests share one processor + tower call.

Requests hand decoded images to :meth:`EncodeBatcher.submit` and await a future. One runner task takes the
oldest pending images, up to a budget in patches, and runs ONE ``VisionEncoder.encode`` call on the tower thread
(one image-processor call, one tower forward over the concatenated ``pixel_values`` with one ``image_grid_thw``
row per image, one device-to-host copy), then resolves each image's future with its own rows. While a batch is
on the tower, new images queue for the next one (continuous batching, as in Orca, Yu et al., OSDI 2022): the
runner waits for the batching window only when the tower is idle and the oldest image has not waited that long.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image

from epdserve.metrics import EncoderMetrics


class ImageEncoder(Protocol):
    """What the batcher needs of :class:`epdserve.encoder.vision.VisionEncoder`."""

    def encode(self, images: list[Image.Image]) -> list[tuple[torch.Tensor, list[int]]]: ...


@dataclass
class _Pending:
    encoder: ImageEncoder
    image: Image.Image
    patches: int
    arrival: float  # loop.time() at submit, in seconds
    future: asyncio.Future


class EncodeBatcher:
    """Batches images across requests for one tower executor (a single thread: one tower call at a time).

    Use it from one event loop. Each image's outcome is its own future: a tower failure fails every image of
    that batch with the tower's exception; an image whose waiter was cancelled is dropped from the batch.

    Attributes:
        calls: tower calls made so far (one per batch).
    """

    def __init__(self, tower: Executor, batch_wait_ms: float = 2.0, max_batch_patches: int = 16384,
                 metrics: EncoderMetrics | None = None) -> None:
        """Args:
            tower: the executor ``encode`` runs on (single-threaded: VisionEncoder is not thread-safe).
            batch_wait_ms: how long the oldest pending image may wait for others while the tower is idle, in
                milliseconds; 0 runs a batch as soon as the tower is free.
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
        self._wait_s = batch_wait_ms / 1000
        self._max_patches = max_batch_patches
        self._queue: list[_Pending] = []
        self._queued_patches = 0
        self._full = asyncio.Event()  # the queue holds a whole budget: stop waiting for the window
        self._runner: asyncio.Task | None = None
        self.calls = 0
        self._metrics = metrics

    @property
    def queued(self) -> int:
        """Images waiting for a tower call now."""
        return len(self._queue)

    def submit(self, encoder: ImageEncoder, image: Image.Image, patches: int) -> asyncio.Future:
        """Queue ``image`` (``patches`` = its ``t*h*w`` grid size) for ``encoder``; must be called on the loop.

        Returns:
            A future of ``(embedding, grid_thw)`` exactly as ``encoder.encode([image])[0]`` would give; it fails
            with the tower's exception if its batch fails. Cancelling it drops the image if not yet running.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
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
                delay = self._queue[0].arrival + self._wait_s - loop.time()
                if delay > 0 and not self._full.is_set():
                    with contextlib.suppress(TimeoutError):  # the window ended; a full budget ends it early
                        await asyncio.wait_for(self._full.wait(), delay)
                    continue
                batch = self._take()
                if not batch:
                    continue
                self.calls += 1
                started = loop.time()
                try:
                    outs = await loop.run_in_executor(self._tower, batch[0].encoder.encode,
                                                      [item.image for item in batch])
                    if len(outs) != len(batch):
                        raise RuntimeError(f"encoder returned {len(outs)} results for {len(batch)} images")
                except Exception as e:  # each waiting request logs and reports it
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(e)
                else:
                    for item, out in zip(batch, outs):
                        if not item.future.done():
                            item.future.set_result(out)
                    if self._metrics is not None:
                        self._metrics.on_batch([started - item.arrival for item in batch],
                                               sum(item.patches for item in batch), loop.time() - started)
                batch = []
        finally:
            # Reached at the end of the queue, or on cancellation (aclose): nothing may be left waiting.
            self._runner = None
            err = RuntimeError("encoding was cancelled (server stopping)")
            for item in batch + self._queue:
                if not item.future.done():
                    item.future.set_exception(err)
            self._queue.clear()
            self._queued_patches = 0

    async def aclose(self) -> None:
        """Stop the runner; images queued or on the tower fail with RuntimeError (the running call finishes)."""
        runner = self._runner
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
