"""One-request prefill forwards replayed from CUDA graphs: one graph per token count, a prompt padded up to the next.

Why: a prefill forward of a 36-layer model launches ~400 kernels from Python. For one request of a few hundred
tokens the host needs longer to launch them than the GPU to run them (H100, 3B shapes: ~12 ms of launches for
~5.5 ms of GPU work, docs/performance.md), and that sits in every request's TTFT while the server is not busy.

Method (SGLang's prefill/"piecewise" CUDA graphs, the decode graphs of :mod:`epdserve.engine.cuda_graph`): capture the
whole prefill forward of one request for a fixed list of token counts, largest first, sharing one memory pool;
inputs live in static device buffers. Per forward: copy the ids, M-RoPE positions and KV slots into those buffers
(padding rows write their KV to a scratch page), scatter the image embeddings into an aligned embedding buffer
(the model splices them with ``torch.where``, which has no data-dependent shape), plan attention with the real
row count (the padding rows are not computed by flashinfer), replay, and read the last real row's logits.
Batches of several requests run eagerly: their launches are shared by more tokens.

Hybrid models (Qwen3.5) on the CUDA DeltaNet kernels: the request's state slot lives in a static buffer too, a
fresh request's slot is zeroed before the replay, and the DeltaNet layers run fla's fixed-length kernels over the
padded rows with the padding's gates set to leave the state as the last real row left it
(:func:`epdserve.models.deltanet_cuda.extend_padded`). Their fla kernels cost ~1 ms of host time per layer
launched eagerly, which set a Qwen3.5-9B prefill forward to ~50 ms whatever its length (H100, issue 42).
"""

from __future__ import annotations

import logging

import torch

from epdserve.engine.cuda_graph import capture_forward, capture_graphs, host_inputs, upload_inputs
from epdserve.device import to_device
from epdserve.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

_SIZES = (1, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072,
          3584, 4096, 5120, 6144, 7168, 8192)


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The captured token counts up to ``max_tokens``: a fixed ladder (1, then 16 .. 8192, at most 1.25x apart from
    256 up, so padding costs little GPU time where prefill is compute-bound) and ``max_tokens`` itself.

    One token (a prompt whose every other token the radix cache holds) has its own graph: padded to 16 rows it
    would run the many-row kernels, whereas one row runs the one-row ones (norms folded into the projections, RoPE
    and the KV write in the qkv GEMV: :mod:`epdserve.models.decode_qkv`), as the eager forward of that row does.

    Raises:
        ValueError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    return [s for s in _SIZES if s < max_tokens] + [max_tokens]


class PrefillGraphRunner:
    """Captured one-request prefill forwards of a model over a
    :class:`~epdserve.attention.flashinfer.FlashInferBackend`.

    Args:
        model: the LM (its prefill ``forward(batch, out=...)`` with aligned ``mm_embeds`` and ``last_rows`` must
            make no host-device copy).
        backend: the model's attention backend; gets one graph-mode prefill wrapper per token count.
        hidden_size: columns of the embedding buffer: the model's ``embed_width`` (Qwen3-VL's rows carry the
            DeepStack levels as extra columns, which the model splits into aligned views, graph-safe).
        vocab_size: columns of the logits.
        max_tokens: most new tokens of a replayed prefill; longer ones run eagerly.
        scratch_page: a KV page no request owns; padding rows write their KV there.
        page_size: tokens per page.
        dtype: the model's dtype (of the embedding buffer).
        states: hybrid models: the :class:`~epdserve.kvcache.state_pool.StatePool` the model's DeltaNet layers
            use (on their CUDA kernels); the captures run on its scratch slot. None for other models.

    Raises:
        torch.OutOfMemoryError: the graphs or their buffers do not fit.
    """

    def __init__(self, model, backend, *, hidden_size: int, vocab_size: int, max_tokens: int, scratch_page: int,
                 page_size: int, dtype: torch.dtype, states=None):
        dev = backend.kv_pool.device
        self.model, self.backend, self.states = model, backend, states
        self.state_slot = None if states is None else torch.full((1,), states.scratch_slot, dtype=torch.int64,
                                                                 device=dev)
        self.sizes = prefill_graph_sizes(max_tokens)
        top = self.sizes[-1]
        self.scratch_slots = scratch_page * page_size + torch.arange(top) % page_size
        # Rows: input id, 3 M-RoPE positions, KV slot, image-row flag. One buffer so the inputs go in one copy.
        self.inputs = torch.zeros(6, top, dtype=torch.int64, device=dev)
        self.inputs[4] = self.scratch_slots.to(dev)
        self.mm_rows = torch.zeros(top, hidden_size, dtype=dtype, device=dev)
        self.mm_mask = torch.zeros(top, dtype=torch.bool, device=dev)
        self.last_row = torch.zeros(1, dtype=torch.int64, device=dev)
        self.logits = torch.empty(1, vocab_size, dtype=torch.float32, device=dev)
        backend.enable_prefill_cuda_graphs(self.sizes)
        pages = [scratch_page] * -(-top // page_size)

        def capture_one(n: int, pool) -> torch.cuda.CUDAGraph:
            self.last_row.fill_(n - 1)
            return capture_forward(model, backend, self._static_batch(n, n, n, pages), self.logits, pool)

        self.graphs, seconds = capture_graphs(self.sizes, capture_one, dev)
        log.info("captured %d prefill CUDA graphs (%d..%d tokens) in %.1f s", len(self.sizes), self.sizes[0], top,
                 seconds)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def _static_batch(self, rows: int, q_len: int, kv_len: int, pages: list[int]) -> ForwardBatch:
        return ForwardBatch(False, self.inputs[0, :rows], self.inputs[1:4, :rows], self.inputs[4, :rows], [q_len],
                            [kv_len], [pages], mm_embeds=self.mm_rows[:rows], mm_mask=self.mm_mask[:rows],
                            last_rows=self.last_row, state_slots=self.state_slot)

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a prefill batch of one request with at most :attr:`max_tokens` new tokens and no state snapshot
        to take on the way (the graphs have none: a scheduler cuts such a prefill in two forwards instead)."""
        return (not batch.is_decode and batch.batch_size == 1 and batch.q_lens[0] <= self.max_tokens
                and not batch.state_snapshots)

    def _set_state_slot(self, batch: ForwardBatch) -> None:
        from epdserve.models.deltanet_cuda import zero_fresh_slots

        self.state_slot.fill_(int(batch.state_slots[0]))
        if batch.kv_lens[0] == batch.q_lens[0]:  # a fresh request starts from the zero state
            zero_fresh_slots(self.states.conv_buffer, self.states.recurrent_buffer, self.state_slot)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run prefill ``batch`` through the graph of the next captured token count: ``input_ids``,
        ``positions``, ``out_slots`` and ``mm_mask`` on the CPU (one pinned host-to-device copy; ``input_ids`` may
        be on the device), ``mm_embeds`` packed (``[mm_mask.sum(), hidden]``) on the CPU or the device. No host
        sync.

        Returns float32 logits ``[1, vocab]`` of the last new token: a view of a static buffer, valid until the
        next replay.

        Raises:
            ValueError: ``batch`` is not a prefill this runner can run (see :meth:`can_run`).
        """
        if not self.can_run(batch):
            raise ValueError(f"no prefill CUDA graph for a {'decode' if batch.is_decode else 'prefill'} batch of "
                             f"{batch.batch_size} requests, {sum(batch.q_lens)} tokens")
        T = batch.q_lens[0]
        n = next(s for s in self.sizes if s >= T)
        dev = self.inputs.device
        host, ids_on_device = host_inputs(batch, n, 6, self.scratch_slots[T:n])
        host[5] = 0
        if batch.mm_embeds is not None:
            rows = batch.mm_mask.cpu().nonzero().squeeze(1)
            host[5, rows] = 1
            emb = batch.mm_embeds if batch.mm_embeds.is_cuda else to_device(batch.mm_embeds, dev)
            self.mm_rows.index_copy_(0, to_device(rows, dev), emb.to(self.mm_rows.dtype))
        upload_inputs(self.inputs, host, batch, ids_on_device)
        self.mm_mask[:n] = self.inputs[5, :n] != 0
        self.last_row.fill_(T - 1)
        if self.states is not None:
            self._set_state_slot(batch)
        self.backend.prepare(self._static_batch(n, T, batch.kv_lens[0], batch.page_table[0]), cuda_graph=True)
        self.graphs[n].replay()
        return self.logits
