"""Where a request's embeddings go once encoded: pushed to the prefill ranks (through this GPU's memory when they
share the machine, else as bytes), copied to host memory for the response or the cache, and cached.

The tower leaves its outputs on the GPU. A prefill server on this machine takes them from there (CUDA IPC, see
:mod:`epdserve.wire.device_share`); the cache's host copy is then made in the background after the push: made
during it, it took as long as the push itself on an H100 host.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from epdserve.encoder.cache import EmbeddingCache
from epdserve.encoder.metrics import EncoderMetrics
from epdserve.encoder.pusher import EmbeddingPusher
from epdserve.kvcache.kv_share import host_id
from epdserve.wire.device_share import DeviceSharer
from epdserve.wire.messages import ImageEmbeddings, encode

log = logging.getLogger("epdserve.encoder")


class EmbeddingOutbox:
    """The encoder's outgoing side. Touched from the event loop only (its blocking copies run on worker threads).

    Args:
        pusher: the ZMQ sockets to prefill ranks.
        cache: the embedding cache it fills.
        metrics: bytes pushed.
        tasks: the servicer's set of tasks (cancelled and awaited at shutdown); background cache copies join it.
    """

    def __init__(self, pusher: EmbeddingPusher, cache: EmbeddingCache, metrics: EncoderMetrics,
                 tasks: set[asyncio.Task]) -> None:
        self._pusher, self._cache, self._metrics, self._tasks = pusher, cache, metrics, tasks
        self._host_id = host_id()  # a request whose targets share it gets its embeddings by CUDA IPC
        self._sharer: DeviceSharer | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # device-to-host copies
        self._filling: set[str] = set()  # keys whose host copies for the cache are being made

    async def push(self, device: torch.device, rid: str, share_host_id: str, keys: list[str],
                   embeddings: list[torch.Tensor], targets: list[str]) -> list[torch.Tensor] | None:
        """Push ``rid``'s embeddings (``embeddings[i]`` of item ``keys[i]``) to every target: through the memory
        of ``device`` (CUDA IPC) when ``share_host_id`` (the targets' machine) is this one and ``device`` is CUDA,
        else their bytes.

        Returns:
            The embeddings in host memory when they went as bytes, else None.

        Raises:
            RequestError: see :meth:`EmbeddingPusher.push`.
        """
        shared = bool(share_host_id) and share_host_id == self._host_id and device.type == "cuda"
        if shared:
            if self._sharer is None:
                self._sharer = DeviceSharer(device)
            per_target = await asyncio.to_thread(self._sharer.share, embeddings, len(targets))
            messages = [encode(ImageEmbeddings(rid=rid, image_hashes=keys, embeddings=handles))
                        for handles in per_target]
            log.debug("rid=%s pushing embeddings through CUDA IPC", rid)
        else:
            embeddings = await asyncio.to_thread(self.on_host, embeddings)
            messages = [encode(ImageEmbeddings(rid=rid, image_hashes=keys, embeddings=embeddings))] * len(targets)
            log.debug("rid=%s pushing embeddings", rid)
        await self._pusher.push(targets, messages)
        self._metrics.on_pushed(sum(memoryview(f).nbytes for f in messages[0]), len(targets))
        return None if shared else embeddings

    def keep(self, keys: list[str], results: dict[str, tuple[torch.Tensor, list[int], bool]],
             on_host: list[torch.Tensor] | None) -> None:
        """Cache what a request encoded on the GPU (``results[key] = (embedding, grid_thw, cache_hit)``): its host
        copies ``on_host`` (in ``keys`` order) when it made them, else copies made in the background."""
        todo: dict[str, tuple[torch.Tensor, list[int]]] = {}
        for i, h in enumerate(keys):
            emb, grid, _ = results[h]
            if not emb.is_cuda or h in self._cache or h in self._filling or h in todo:
                continue
            if on_host is not None:
                self._cache.put(h, on_host[i], grid)
            else:
                todo[h] = (emb, grid)
        if todo:
            self._filling.update(todo)
            task = asyncio.create_task(self._fill_cache(todo))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fill_cache(self, todo: dict[str, tuple[torch.Tensor, list[int]]]) -> None:
        try:
            hosts = await asyncio.to_thread(self.on_host, [emb for emb, _ in todo.values()])
            for (h, (_, grid)), host in zip(todo.items(), hosts):
                self._cache.put(h, host, grid)
        finally:
            self._filling.difference_update(todo)

    def on_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` in host memory (those already there as they are). Blocking: call it from a worker thread.
        CUDA copies run on a stream of their own, so they never wait for the tower's queued work (the tower
        returns its outputs complete)."""
        if not any(t.is_cuda for t in tensors):
            return tensors
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(next(t.device for t in tensors if t.is_cuda))
        with torch.cuda.stream(self._copy_stream):
            # Pinned: ~20x the bandwidth of a pageable copy, and a cache hit shared later goes back to the GPU
            # as fast. The allocations come from torch's caching host allocator.
            out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                   if t.is_cuda else t for t in tensors]
            self._copy_stream.synchronize()
        return out
