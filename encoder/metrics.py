"""The encoder server's Prometheus metrics (conventions: :mod:`epdserve.metrics`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from epdserve.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, StageMetrics

# Patches per vision tower call (before the 2x2 merge; one 448x448 image is 1024).
PATCH_BUCKETS = (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class EncoderMetrics(StageMetrics):
    """The encoder server's metrics (see the module docstring for the conventions)."""

    def __init__(self) -> None:
        super().__init__("encoder")
        self.images = self._counter("encoder_images", "Images received in Encode requests (repeats included)")
        self.images_encoded = self._counter("images_encoded", "Images run through the vision tower")
        self.videos = self._counter("encoder_videos", "Videos received in Encode requests (repeats included)")
        self.videos_encoded = self._counter("videos_encoded", "Videos run through the vision tower (one tower call "
                                            "each)")
        self.cache_hits = self._counter("embedding_cache_hits", "Embedding cache lookups that found the image")
        self.cache_misses = self._counter("embedding_cache_misses", "Embedding cache lookups that missed")
        self.batch_size = self._histogram("batch_size", "Images per vision tower call", BATCH_BUCKETS)
        self.batch_patches = self._histogram("encoder_batch_patches", "Patches (before the merge) per vision "
                                             "tower call", PATCH_BUCKETS)
        self.encode_latency = self._histogram("encode_latency_seconds", "Duration of one vision tower call "
                                              "(image processor included), seconds", LATENCY_BUCKETS)
        self.queue_time = self._histogram("queue_time_seconds", "Time an image waited for its tower call, "
                                          "seconds", LATENCY_BUCKETS)
        self.stage_latency = self._histogram("stage_latency_seconds", "Duration of one Encode request, seconds",
                                             LATENCY_BUCKETS)
        # The parts of a request around the tower call, so a slow stage says which part is slow (issue 45).
        self.decode_time = self._histogram("image_decode_seconds", "Decoding one image off the event loop (the "
                                           "wait for a worker thread included), seconds", LATENCY_BUCKETS)
        self.push_time = self._histogram("embedding_push_seconds", "Handing one request's embeddings to its "
                                         "prefill ranks (written to every connection), seconds", LATENCY_BUCKETS)
        self.bytes_sent = self._counter("embedding_bytes_sent", "Embedding bytes pushed to prefill ranks (each "
                                        "target counted)")
        self.running = self._gauge("num_running_reqs", "Encode requests in progress", mode="livesum")
        self.queued = self._gauge("num_queue_reqs", "Images waiting for a vision tower call")
        self.cache_bytes = self._gauge("embedding_cache_bytes", "Bytes of embeddings in the cache")
        self.cache_entries = self._gauge("embedding_cache_entries", "Images in the embedding cache")
        self.rooms = self._gauge("encoder_bootstrap_rooms", "Embeddings held under a bootstrap room until a prefill "
                                 "server claims them (smg --epd-disaggregation)")

    def watch(self, cache: Any, batcher: Any) -> None:
        """Read the cache's ``size_bytes`` and ``len()`` and the batcher's ``queued`` at each scrape (plain int
        reads, safe from the metrics server's thread)."""
        self.cache_bytes.set_function(lambda: cache.size_bytes)
        self.cache_entries.set_function(lambda: len(cache))
        self.queued.set_function(lambda: batcher.queued)

    @contextlib.contextmanager
    def track_request(self) -> Iterator[None]:
        """Around one Encode request: counts it in progress, observes its duration, and counts it done with
        outcome ``ok``, or ``error`` if the block raises (a gRPC abort does)."""
        self.running.inc()
        start = time.monotonic()
        outcome = "error"
        try:
            yield
            outcome = "ok"
        finally:
            self.running.dec()
            self.stage_latency.observe(time.monotonic() - start)
            self.on_request_done(outcome)

    def on_cache_lookup(self, hit: bool) -> None:
        """One embedding-cache lookup of a distinct image of a request."""
        (self.cache_hits if hit else self.cache_misses).inc()

    def on_batch(self, queue_times: list[float], patches: int, seconds: float, video: bool = False) -> None:
        """One vision tower call over ``len(queue_times)`` images that waited ``queue_times`` seconds each, or
        (``video``) over one video; patches, duration and queue time count for both."""
        if video:
            self.videos_encoded.inc(len(queue_times))
        else:
            self.batch_size.observe(len(queue_times))
            self.images_encoded.inc(len(queue_times))
        self.batch_patches.observe(patches)
        self.encode_latency.observe(seconds)
        for q in queue_times:
            self.queue_time.observe(q)

    def on_pushed(self, nbytes: int, num_targets: int) -> None:
        """One ``ImageEmbeddings`` message of ``nbytes`` bytes pushed to ``num_targets`` prefill ranks."""
        self.bytes_sent.inc(nbytes * num_targets)
