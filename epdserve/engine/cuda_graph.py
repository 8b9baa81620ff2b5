"""Decode forwards replayed from CUDA graphs: one graph per batch size, a batch padded up to the next size.

Why: a decode step of a 36-layer model launches ~400 kernels; launched one by one from Python the step is bound
by the CPU (~80 % of wall time on an H100, ``../shared/notes/qwen-vl-facts.md``). A replayed graph launches them
all in one call.

Method (mini-sglang ``python/minisgl/engine/graph.py``, SGLang ``CudaGraphRunner``): capture the decode forward
for a fixed list of batch sizes, largest first, sharing one memory pool; inputs live in static device buffers.
Per step: copy the step's inputs into those buffers with one host-to-device copy, pad the batch with rows that
attend to one scratch page and write their KV there, plan attention on the host (flashinfer's graph-mode
wrapper fills fixed-size index buffers the captured kernels read), replay, and read the logits rows of the real
requests from a static output buffer.
"""

from __future__ import annotations

import logging
import time

import torch

from epdserve.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The captured batch sizes up to ``max_bs``: 1, 2, 4, 8, then every multiple of 8 (SGLang's list), and
    ``max_bs`` itself. Padding waste is at most 7 rows above 8. Raises ValueError when ``max_bs < 1``."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be positive, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


def capture_forward(model, backend, batch: ForwardBatch, out: torch.Tensor, pool) -> torch.cuda.CUDAGraph:
    """Plan ``batch`` on ``backend``'s graph-mode wrapper, run ``model(batch, out=out)`` once eagerly (JIT builds
    and lazy allocations happen outside the graph), then capture the same call into a new graph that allocates
    from memory pool ``pool`` (None: a new pool; pass the returned graph's ``pool()`` to the next capture so all
    share one). Call under ``torch.inference_mode()``; ``batch``'s tensors must be static device buffers.

    Raises:
        RuntimeError: an operation that cannot be captured (a host sync, a data-dependent shape).
    """
    backend.prepare(batch, cuda_graph=True)
    model(batch, out=out)
    torch.cuda.synchronize(out.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        model(batch, out=out)
    return graph


def capture_graphs(sizes: list[int], capture_one,
                   device: torch.device) -> tuple[dict[int, torch.cuda.CUDAGraph], float]:
    """One graph per size, the largest first so that the smaller ones allocate from its memory pool (SGLang and
    vLLM capture in this order for that reason). ``capture_one(size, pool)`` returns the graph of ``size``
    (see :func:`capture_forward`). Returns ``(graphs by size, seconds taken)``.

    Raises:
        RuntimeError: an operation that cannot be captured.
        torch.OutOfMemoryError: the graphs do not fit.
    """
    t0 = time.monotonic()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    pool = None
    with torch.inference_mode():
        for size in reversed(sizes):
            graphs[size] = capture_one(size, pool)
            pool = graphs[size].pool()
    torch.cuda.synchronize(device)
    return graphs, time.monotonic() - t0


def host_inputs(batch: ForwardBatch, rows: int, num_rows: int, pad_slots,
                width: int | None = None) -> tuple[torch.Tensor, bool]:
    """The first rows of a graph's static inputs for ``batch`` (token ids, 3 M-RoPE positions, KV slots) in a
    pinned int64 ``[num_rows, width]`` host buffer (``width`` None: ``rows``), padded up to ``rows`` past the batch's
    tokens with id 0, position 0 and ``pad_slots`` (an int or a ``[rows - T]`` tensor of scratch slots); columns
    from ``rows`` on are left unset (no graph of ``rows`` reads them). Rows from 5 on are the caller's.

    Returns ``(host, ids_on_device)``: with ``ids_on_device`` the ids (the overlap scheduler's last samples, or a
    TP broadcast) are not in ``host``; :func:`upload_inputs` copies them on the device.
    """
    T = len(batch.out_slots)
    host = torch.empty(num_rows, width or rows, dtype=torch.int64, pin_memory=True)
    ids_on_device = batch.input_ids.is_cuda
    host[0, :T] = 0 if ids_on_device else batch.input_ids
    host[1:4, :T] = batch.positions
    host[4, :T] = batch.out_slots
    host[:4, T:rows] = 0
    host[4, T:rows] = pad_slots
    return host, ids_on_device


def upload_inputs(inputs: torch.Tensor, host: torch.Tensor, batch: ForwardBatch, ids_on_device: bool) -> None:
    """Copy ``host`` (from :func:`host_inputs`) into the static ``inputs`` in one non-blocking copy, then the
    device-side ids. A ``host`` as wide as ``inputs`` goes over as one contiguous copy; a narrower one is a
    strided destination, which torch copies through a device temporary and a second kernel."""
    if host.shape == inputs.shape:
        inputs.copy_(host, non_blocking=True)
    else:
        inputs[:, :host.shape[1]].copy_(host, non_blocking=True)
    if ids_on_device:
        inputs[0, :len(batch.input_ids)].copy_(batch.input_ids)


class CudaGraphRunner:
    """Captured decode forwards of a model over a :class:`~epdserve.attention.flashinfer.FlashInferBackend`.

    Args:
        model: the LM (its ``forward(batch, out=...)`` must make no host-device copy for decode batches).
        backend: the model's attention backend; gets one graph-mode decode wrapper per size.
        vocab_size: columns of the logits.
        max_bs: largest captured batch; larger batches run eagerly.
        scratch_page: a KV page no request owns; padding rows attend to it and write their KV there.
        page_size: tokens per page.
        scratch_state_slot: hybrid models (Qwen3.5): the state pool's scratch slot; the graphs then also take each
            row's state slot from a static buffer (``ForwardBatch.state_slots`` as a device tensor) and padding
            rows read and write this slot. None for models without linear-attention states.
        tp: the model's TP group. With more than one rank, each graph starts by broadcasting rank 0's input ids
            over the group (the other ranks' ids are ignored, as :meth:`ModelRunner.forward
            <epdserve.engine.model_runner.ModelRunner.forward>` documents): inside the graph the broadcast costs
            the host nothing, where an eager one took 6 % of a TP-2 decode step's host time at one request (two
            H200s, docs/performance.md, fifteenth session).

    Raises:
        torch.OutOfMemoryError: the graphs or their buffers do not fit.
    """

    def __init__(self, model, backend, *, vocab_size: int, max_bs: int, scratch_page: int, page_size: int,
                 scratch_state_slot: int | None = None, tp=None):
        dev = backend.kv_pool.device
        self.model, self.backend = model, backend
        self.sizes = graph_batch_sizes(max_bs)
        self.scratch_page, self.scratch_state_slot = scratch_page, scratch_state_slot
        top = self.sizes[-1]
        # Rows: input id, 3 M-RoPE positions, KV slot (and, hybrid models, state slot). One buffer so a step's
        # inputs go over in one copy.
        self.inputs = torch.zeros(5 if scratch_state_slot is None else 6, top, dtype=torch.int64, device=dev)
        self.inputs[4] = scratch_page * page_size
        if scratch_state_slot is not None:
            self.inputs[5] = scratch_state_slot
        self.logits = torch.empty(top, vocab_size, dtype=torch.float32, device=dev)
        backend.enable_cuda_graphs(self.sizes)
        forward = model
        if tp is not None and tp.size > 1:
            def forward(batch: ForwardBatch, out: torch.Tensor) -> torch.Tensor:
                tp.broadcast(batch.input_ids)
                return model(batch, out=out)
        self.graphs, seconds = capture_graphs(
            self.sizes, lambda bs, pool: capture_forward(
                forward, backend, self._static_batch(bs, [1] * bs, [[scratch_page]] * bs), self.logits[:bs], pool),
            dev)
        log.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.sizes), self.sizes[0], top,
                 seconds)

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def _static_batch(self, bs: int, kv_lens: list[int], page_table: list[list[int]]) -> ForwardBatch:
        return ForwardBatch(True, self.inputs[0, :bs], self.inputs[1:4, :bs], self.inputs[4, :bs], [1] * bs,
                            kv_lens, page_table,
                            state_slots=None if self.scratch_state_slot is None else self.inputs[5, :bs])

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a decode batch of at most :attr:`max_bs` requests without image embeddings."""
        return batch.is_decode and batch.batch_size <= self.max_bs and batch.mm_embeds is None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run decode ``batch`` through the graph of the next captured size: ``input_ids`` on the CPU or the
        device, the other tensors on the CPU (one pinned host-to-device copy; no host sync).

        Returns float32 logits ``[B, vocab]``: a view of a static buffer, valid until the next replay.

        Raises:
            ValueError: ``batch`` is not a decode batch this runner can run (see :meth:`can_run`).
        """
        if not self.can_run(batch):
            raise ValueError(f"no CUDA graph for a {'decode' if batch.is_decode else 'prefill'} batch of "
                             f"{batch.batch_size}")
        B = batch.batch_size
        bs = next(s for s in self.sizes if s >= B)
        host, ids_on_device = host_inputs(batch, bs, self.inputs.shape[0],
                                          self.scratch_page * self.backend.kv_pool.page_size, self.inputs.shape[1])
        if self.scratch_state_slot is not None:
            host[5, :B] = torch.as_tensor(batch.state_slots, dtype=torch.int64)
            host[5, B:bs] = self.scratch_state_slot
        upload_inputs(self.inputs, host, batch, ids_on_device)
        pad = bs - B
        padded = self._static_batch(bs, list(batch.kv_lens) + [1] * pad,
                                    list(batch.page_table) + [[self.scratch_page]] * pad)
        self.backend.prepare(padded, cuda_graph=True)
        self.graphs[bs].replay()
        return self.logits[:B]
