"""CUDA graphs of a transformers Qwen2-VL / Qwen2.5-VL vision tower, one per image grid, for lone images.

Why: eagerly the 3B tower spends ~41 ms of host time launching ~1,000 small kernels per call against ~11 ms of
GPU work for one 448x448 image (docs/performance.md), so a lone image waits on Python, not on the GPU. A replayed
graph launches them all at once.

What makes the tower capturable: everything it derives from ``grid_thw`` on the host (rotary position ids,
``cu_seqlens``, Qwen2.5-VL's window index, the max sequence lengths that ``.item()`` would sync for) is
computed once per grid by transformers' own helpers (``transformers.vision_utils``) and passed back to the
tower's ``forward`` as the precomputed kwargs transformers accepts for exactly this. The graphed call is then the
unchanged transformers forward. Only the packed-attention implementation
(:mod:`epdserve.encoder.varlen_attention`) is capturable, so graphs are for CUDA with that attention.

Only a tower call of one image replays a graph: that is the call that waits on the host (H100, 3B tower, 448²:
7.1 ms per image from a graph against 20.6 ms compiled without, docs/performance.md). A batch of several images
runs as one eager call: its GPU time hides the launches, and graphs per batch shape were slower there (87 against
128 images/s at 32 concurrent, captures included), since every new (grid, batch size) needs its own capture. A
grid's graph is captured on its second lone use (a one-off image size runs eagerly, with the precomputed
metadata) and kept in an LRU of ``--cuda-graphs`` entries; all share one memory pool, which is safe because the
graphs replay one at a time on one thread. Same technique as SGLang's and vLLM's CUDA-graph runners for the LM.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

log = logging.getLogger(__name__)

Grid = tuple[int, int, int]
# Metadata sets kept, on the device (index tensors: ~16 bytes per patch, so up to MBs for a large batch); batches
# of recurring shapes reuse theirs.
_MAX_METADATA = 32


def tower_metadata(model: torch.nn.Module, grids: list[Grid], device: torch.device) -> dict:
    """The tower inputs transformers derives from ``grid_thw``, precomputed for ``grids`` (one ``(t, h, w)`` per
    image, in patches) and placed on ``device``: ``position_ids`` ``[P, 2]`` int64, ``cu_seqlens`` int32 and
    ``max_seqlen`` (patches), plus for a windowed tower (Qwen2.5-VL) ``window_index`` ``[P / merge**2]`` int64,
    ``cu_window_seqlens`` int32 and ``max_window_seqlen``. Pass a copy as ``**kwargs`` to the tower's ``forward``
    (it pops them)."""
    grid = torch.tensor(grids, dtype=torch.int64)
    cu = get_vision_cu_seqlens(grid)
    meta = {"position_ids": get_vision_position_ids(grid, model.spatial_merge_size).to(device),
            "cu_seqlens": cu.to(device), "max_seqlen": int((cu[1:] - cu[:-1]).max())}
    if getattr(model, "window_size", None):
        index, cu_win = get_vision_window_index(grid, spatial_merge_size=model.spatial_merge_size,
                                                window_size=model.window_size, patch_size=model.patch_size)
        meta.update(window_index=index.to(device), cu_window_seqlens=cu_win.to(device),
                    max_window_seqlen=int((cu_win[1:] - cu_win[:-1]).max()))
    return meta


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # static input [t*h*w, patch_dim]
    out: torch.Tensor  # static output [tokens, hidden]
    meta: dict  # the metadata tensors the graph reads (held here: the metadata LRU may drop its entry)


class TowerGraphs:
    """Runs a vision tower on a batch of images, a lone image through its grid's CUDA graph (see the module doc).

    Not thread-safe: call :meth:`run` from one thread (the encoder's tower thread).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, max_graphs: int):
        """``model``: a transformers Qwen2-VL / Qwen2.5-VL vision tower on ``device`` (CUDA) whose attention is
        :mod:`epdserve.encoder.varlen_attention`; ``max_graphs``: graphs kept (LRU), 0 = eager only."""
        self.model, self.device, self.max_graphs = model, device, max_graphs
        self._graphs: OrderedDict[Grid, _Graph] = OrderedDict()
        self._seen: set[Grid] = set()
        self._meta: OrderedDict[tuple[Grid, ...], dict] = OrderedDict()  # by the grids of one tower call
        self._pool = None  # one memory pool for all graphs, made at the first capture

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """The tower's merged output for images packed in ``pixels`` (``[sum t*h*w, patch_dim]``, the processor's
        ``pixel_values`` in the tower dtype, on the device) with patch grids ``grids``: ``[sum tokens_i,
        hidden]`` in image order, equal to ``model(pixels, grid_thw=...).pooler_output``. One image replays its
        grid's graph once captured; several run in one eager call."""
        grids = [tuple(g) for g in grids]
        if not self.max_graphs or len(grids) != 1:
            return self._forward(pixels, tuple(grids))
        grid = grids[0]
        g = self._graphs.get(grid)
        if g is None and grid in self._seen:
            try:
                g = self._capture(grid, pixels)
            except RuntimeError as e:  # e.g. an op that cannot be captured: serve eagerly from now on
                log.warning("vision-tower CUDA graph capture failed, running the tower eagerly: %s", e)
                self.max_graphs = 0
                self._graphs.clear()
        if g is not None:
            self._graphs.move_to_end(grid)
            g.pixels.copy_(pixels)
            g.graph.replay()
            return g.out.clone()  # the next replay reuses g.out and the shared pool
        self._seen.add(grid)
        return self._forward(pixels, (grid,))

    def _forward(self, pixels: torch.Tensor, grids: tuple[Grid, ...]) -> torch.Tensor:
        meta = self._meta.get(grids)
        if meta is None:
            meta = self._meta[grids] = tower_metadata(self.model, list(grids), self.device)
            while len(self._meta) > _MAX_METADATA:
                self._meta.popitem(last=False)
        self._meta.move_to_end(grids)
        # With every kwarg precomputed the tower never reads grid_thw's values; a host tensor keeps a host-to-
        # device copy out of the captured stream.
        return self.model(pixels, grid_thw=torch.tensor(grids), **dict(meta)).pooler_output

    def _capture(self, grid: Grid, pixels: torch.Tensor) -> _Graph:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        static = pixels.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        grids = (grid,)
        with torch.cuda.stream(stream):  # warm-up off the capture (lazy inits, autotuning)
            self._forward(static, grids)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the encoder's other threads (image decoding, the event loop) may touch CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(static, grids)
        g = self._graphs[grid] = _Graph(graph, static, out, self._meta[grids])
        log.debug("captured a vision-tower graph for an image of grid %s (%d graphs)", grid, len(self._graphs))
        return g
