"""The LM half of a prefill or decode server: weights, paged KV pool and attention backend behind one forward."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from epdserve.attention.select import choose_backend, make_backend
from epdserve.engine.busy import DeviceBusy
from epdserve.engine.distributed import TPGroup
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool
from epdserve.kvcache.kv_share import export_pool, new_shm_path
from epdserve.engine import state_io
from epdserve.kvcache.state_pool import StatePool
from epdserve.logging_setup import process_age_s
from epdserve.wire.messages import KVPoolHandle
from epdserve.models import language_model_class
from epdserve.models.config import ModelConfig
from epdserve.models.parallel import head_shard
from epdserve.models.weights import iter_lm_weights

log = logging.getLogger(__name__)

_CPU_DEFAULT_PAGES = 4096
DEFAULT_STATE_SLOTS = 64  # hybrid models: requests whose linear-attention states fit at once


class ModelRunner:
    """Loads a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 language model and runs :class:`ForwardBatch` es over its
    paged KV cache (and, for Qwen3.5, its state pool).

    Attributes: ``config`` (:class:`ModelConfig`), ``num_pages``, ``page_size``, ``device``, ``dtype``,
    ``kv_pool`` (:class:`KVPool`), ``model`` (the LM of :func:`~epdserve.models.language_model_class`:
    :class:`~epdserve.models.qwen2_vl_lm.Qwen2VLLanguageModel` or
    :class:`~epdserve.models.qwen3_vl_lm.Qwen3VLLanguageModel` or
    :class:`~epdserve.models.qwen3_5_lm.Qwen3_5LanguageModel`), ``state_pool`` (hybrid models' :class:`StatePool`,
    else None), ``backend``, ``tp``
    (:class:`TPGroup`), ``heads`` (this rank's :class:`~epdserve.models.parallel.HeadShard`), ``failed`` (always
    None here; a TP server's rank-0 runner sets it when a rank is lost).

    With ``tp.size > 1`` this is one TP rank's runner: its weights, KV pool (its KV heads) and attention backend
    hold this rank's heads, and every rank must make the same calls in the same order (the rank-0 server's
    :class:`~epdserve.engine.tp_runner.TPRunner` tells the other ranks which). Inputs and outputs stay whole: token ids
    come from rank 0, logits and the KV that :meth:`read_kv` returns cover every head and the full vocabulary.
    """

    failed: str | None = None

    def __init__(self, model_path: str, *, device: torch.device, dtype: torch.dtype, num_pages: int,
                 page_size: int, attention_backend: str = "auto", decode_attention_backend: str = "auto",
                 mem_fraction: float = 0.5,
                 cuda_graph_max_bs: int = 0, prefill_graph_max_tokens: int = 0, share_kv: bool = False,
                 tp: TPGroup | None = None, num_state_slots: int = DEFAULT_STATE_SLOTS):
        """Load config and LM weights (vision weights are skipped), then size and allocate the KV pool.

        ``num_pages == 0`` sizes the pool automatically: on CUDA ``mem_fraction`` of the free memory left after
        loading the weights (the smallest over the TP ranks, so every rank has the same page ids), on CPU 4096
        pages. The pool holds one more page than ``num_pages``: the scratch page
        that CUDA-graph padding rows write to; pages ``0 .. num_pages - 1`` are the schedulers'.

        With the flashinfer backend the model uses flashinfer's fused norm/RoPE/activation kernels, and
        ``cuda_graph_max_bs > 0`` captures decode CUDA graphs up to that batch size (see
        :mod:`epdserve.engine.cuda_graph`), and ``prefill_graph_max_tokens > 0`` one-request prefill graphs up to that
        many new tokens (:mod:`epdserve.engine.prefill_graph`); the graphs need the flashinfer backend and are skipped
        otherwise.

        Hybrid models (Qwen3.5, ``config.is_hybrid``): the KV pool holds the attention layers only
        (``config.num_kv_layers``) and ``state_pool`` (:class:`StatePool`, ``num_state_slots`` slots plus a scratch
        one) holds the linear-attention layers' conv and recurrent states; every batch names its requests' slots
        (``ForwardBatch.state_slots``). Decode graphs pad with rows on the scratch slot; prefill graphs need the CUDA
        DeltaNet kernels (``fla-core``), without them there are none.
        Otherwise ``state_pool`` is None.

        ``share_kv`` makes the KV pool mappable by other processes of this machine (:meth:`kv_handle`): on CUDA
        every pool is; on the CPU the pool is then allocated in a /dev/shm file.

        Raises:
            FileNotFoundError: missing config or weights.
            ValueError: unsupported model, bad weights, bad backend name, or no room for one page.
        """
        t0 = time.monotonic()
        # Seconds each part of the start-up took (the servers' ready lines print them; issue 43), from the
        # process's start: "process" is the interpreter, the imports and the server's set-up before the model.
        self.startup_s: dict[str, float] = {} if (age := process_age_s()) is None else {"process": age}
        self.busy: DeviceBusy | None = None  # a server's device_busy_seconds metric (track_device_busy)
        self.device, self.dtype, self.page_size = torch.device(device), dtype, page_size
        self.tp = tp or TPGroup.single(self.device)
        t0 = self._create_context(t0)
        self.config = cfg = ModelConfig.load(model_path)
        self.heads = head_shard(cfg.num_heads, cfg.num_kv_heads, self.tp)
        attention_backend, kernels = self._kernel_build(attention_backend)
        # Built on the meta device so no memory is spent on random init; the weights fill it in place.
        with torch.device("meta"):
            model = language_model_class(cfg)(cfg, tp=self.tp)
        model.materialize(self.device, dtype)
        weights = iter_lm_weights(model_path, tie_word_embeddings=cfg.tie_word_embeddings, device=self.device)
        model.load_weights((name, t.to(dtype)) for name, t in weights)
        self.model = model.eval().requires_grad_(False)
        self.startup_s["weights"] = time.monotonic() - t0
        if kernels is not None:  # what the build needed beyond the weights' time
            self.startup_s["kernels"] = kernels.wait()
        if num_pages <= 0:
            num_pages = self.tp.min_int(self._auto_pages(mem_fraction))
        self.num_pages = num_pages
        self.share_kv = share_kv
        self.kv_pool = KVPool(num_layers=cfg.num_kv_layers, num_pages=num_pages + 1, page_size=page_size,
                              num_kv_heads=self.heads.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                              device=self.device,
                              shm_path=new_shm_path() if share_kv and self.device.type == "cpu" else "")
        self.backend = make_backend(attention_backend, self.kv_pool, self.heads.num_heads, kernels,
                                    decode=decode_attention_backend)
        self.model.attn = self.backend
        self.model.use_fused_ops(self.backend.uses_flashinfer)
        self.state_pool = self._state_pool(num_state_slots) if cfg.is_hybrid else None
        if self.state_pool is not None:
            self.model.states = self.state_pool
            if not self.model.deltanet_kernels:  # the torch references loop over requests: not capturable
                prefill_graph_max_tokens = 0
        self._capture_graphs(cuda_graph_max_bs, prefill_graph_max_tokens)
        if kernels is not None:
            kernels.start_background()

    def _capture_graphs(self, cuda_graph_max_bs: int, prefill_graph_max_tokens: int) -> None:
        """Capture the decode and prefill CUDA graphs (flashinfer backend only; their seconds: ``graphs``)."""
        self.graphs = None
        t0 = time.monotonic()
        if cuda_graph_max_bs > 0 and self.backend.uses_flashinfer:
            self.graphs = self._decode_graphs(cuda_graph_max_bs)
        self.prefill_graphs = None
        if prefill_graph_max_tokens > 0 and self.backend.uses_flashinfer:
            from epdserve.engine.prefill_graph import PrefillGraphRunner

            cfg = self.config
            self.prefill_graphs = PrefillGraphRunner(
                self.model, self.backend, hidden_size=cfg.embed_width, vocab_size=cfg.vocab_size,
                max_tokens=prefill_graph_max_tokens, scratch_page=self.num_pages, page_size=self.page_size,
                dtype=self.dtype, states=self.state_pool)
        if self.graphs is not None or self.prefill_graphs is not None:
            self.startup_s["graphs"] = time.monotonic() - t0

    def _kernel_build(self, attention_backend: str):
        """``(backend name, build)``: the attention backend ``attention_backend`` resolves to and, for flashinfer, the
        build of its kernel modules (:mod:`epdserve.attention.flashinfer_kernels`), started now so that it runs while
        the weights load; else None."""
        name = choose_backend(attention_backend, self.device, self.config.head_dim, self.dtype)
        if name != "flashinfer":
            return name, None
        from epdserve.attention.flashinfer_kernels import start_kernel_build

        return name, start_kernel_build(self.config.head_dim, self.heads.num_heads, self.heads.num_kv_heads,
                                        self.dtype, self.device)

    def _decode_graphs(self, max_bs: int):
        """The decode CUDA graphs. A hybrid model's take each row's state slot from a static buffer (padding rows:
        the scratch slot). CI has no GPU (tests/test_qwen3_5_gpu.py checks them against eager steps on one): should
        their capture fail, decode runs eagerly (logged) rather than the server failing to start."""
        from epdserve.engine.cuda_graph import CudaGraphRunner

        scratch = None if self.state_pool is None else self.state_pool.scratch_slot
        try:
            return CudaGraphRunner(self.model, self.backend, vocab_size=self.config.vocab_size, max_bs=max_bs,
                                   scratch_page=self.num_pages, page_size=self.page_size, scratch_state_slot=scratch,
                                   tp=self.tp)
        except RuntimeError as e:
            if scratch is None:
                raise
            log.warning("decode CUDA graphs of the hybrid model could not be captured (%s): decode runs eagerly", e)
            return None

    def _state_pool(self, num_slots: int) -> StatePool:
        """The linear-attention states of a hybrid model, this rank's heads: conv ``[conv_dim, kernel]`` in the
        model dtype, recurrent ``[value_heads, key_dim, value_dim]`` in float32 (see :class:`StatePool`); in
        /dev/shm files with ``share_kv`` on the CPU, like the KV pool."""
        from epdserve.models.qwen3_5_deltanet import deltanet_local_shapes

        cfg = self.config
        conv, rec = deltanet_local_shapes(cfg, self.tp)
        shm = (new_shm_path(), new_shm_path()) if self.share_kv and self.device.type == "cpu" else ("", "")
        return StatePool(num_slots, len(cfg.linear_layers), conv, rec, self.dtype, self.device, shm_paths=shm)

    def _auto_pages(self, mem_fraction: float) -> int:
        if self.device.type != "cuda":
            return _CPU_DEFAULT_PAGES
        free, _ = torch.cuda.mem_get_info(self.device)
        cfg = self.config
        per_page = KVPool.bytes_per_page(num_layers=cfg.num_kv_layers, page_size=self.page_size,
                                         num_kv_heads=self.heads.num_kv_heads, head_dim=cfg.head_dim,
                                         dtype=self.dtype)
        pages = int(free * mem_fraction) // per_page
        if pages < 1:
            raise ValueError(f"no room for a KV page: {free} bytes free, {per_page} bytes per page")
        return pages

    def _create_context(self, t0: float) -> float:
        """Create the device's CUDA context now, so the ready line shows its seconds (``startup_s["device"]``)
        apart from reading the weights. Returns the time the next part starts (``time.monotonic()``)."""
        if self.device.type != "cuda":
            return t0
        torch.zeros(1, device=self.device)
        self.startup_s["device"] = time.monotonic() - t0
        return time.monotonic()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` (tensors on any device; moved here) and return float32 logits ``[B, vocab]`` at each
        request's last new token. New K/V land in ``batch.out_slots``. Decode batches and one-request prefills
        that a CUDA graph covers are replayed (their logits are a view valid until the next forward); the rest run
        eagerly.

        With TP, rank 0's ``input_ids`` are broadcast to the other ranks first (theirs are ignored: any ``[T]``
        int64 tensor), so ids that rank 0 holds only on the device (overlapped decode) never visit the host.

        Raises:
            ValueError: inconsistent page tables / lengths (from the attention backend).
        """
        if self.busy is None:
            return self._forward(batch)
        with self.busy.measure(len(batch.q_lens), sum(batch.q_lens)):
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        dev = self.device
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.replay(batch)  # broadcasts rank 0's ids inside the graph (CudaGraphRunner's tp)
        if self.tp.size > 1:
            ids = batch.input_ids.to(dev, torch.int64, non_blocking=True).contiguous()
            batch = dataclasses.replace(batch, input_ids=self.tp.broadcast(ids))
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            return self.prefill_graphs.replay(batch)
        batch = dataclasses.replace(
            batch,
            input_ids=batch.input_ids.to(dev, non_blocking=True),
            positions=batch.positions.to(dev, non_blocking=True),
            out_slots=batch.out_slots.to(dev, non_blocking=True),
            mm_embeds=None if batch.mm_embeds is None else batch.mm_embeds.to(dev, non_blocking=True),
            mm_mask=None if batch.mm_mask is None else batch.mm_mask.to(dev, non_blocking=True),
        )
        with torch.inference_mode():
            self.backend.prepare(batch)
            logits = self.model(batch)
        return logits.clone()  # a normal tensor, so callers may edit it in place outside inference mode

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """KV at ``slots`` ``[n]`` as a contiguous CPU tensor ``[num_layers, 2, n, num_kv_heads, head_dim]`` in the
        model dtype (the :class:`~epdserve.wire.messages.KVTransfer` payload), all of the model's KV heads.

        With TP every rank calls it: the ranks' head shards are all-gathered on the device (KV heads replicated
        over several ranks are taken once), so any rank returns the whole KV.
        """
        with torch.no_grad():
            kv = self.kv_pool.read(slots.to(self.device))
            if self.tp.size > 1:
                kv = self.tp.all_gather(kv, dim=3)
                replicas = max(1, self.tp.size // self.config.num_kv_heads)
                if replicas > 1:  # rank r holds KV head r // replicas: keep ranks 0, replicas, 2 * replicas, ...
                    kv = kv[:, :, :, ::replicas]
            return kv.to("cpu").contiguous()

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store a received ``kv`` ``[num_layers, 2, n, num_kv_heads, head_dim]`` (all of the model's KV heads) at
        ``slots`` ``[n]``.

        With TP every rank calls it: rank 0's ``kv`` is broadcast (the other ranks pass any tensor of that shape
        and the model dtype, on their device) and each rank keeps its own heads, so any prefill TP size can feed
        any decode TP size.

        Raises:
            ValueError: ``kv`` has the wrong shape.
        """
        with torch.no_grad():
            if self.tp.size > 1:
                kv = self.tp.broadcast(kv.to(self.device, self.dtype).contiguous())
                kv = kv[:, :, :, self.heads.kv_start:self.heads.kv_start + self.heads.num_kv_heads]
            self.kv_pool.write_all(slots.to(self.device), kv)

    def read_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hybrid models: state slot ``slot``'s whole linear-attention state on the CPU, ``(conv [layers,
        conv_dim, kernel], recurrent [layers, value_heads, key_dim, value_dim])``, every DeltaNet head (the
        :class:`~epdserve.wire.messages.StateHandoff` payload; :mod:`epdserve.engine.state_io`). With TP
        every rank calls it."""
        return state_io.read_state(self.state_pool, slot, self.config, self.tp)

    def write_state(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Hybrid models: store a received whole state into ``slot`` (with TP every rank calls it; rank 0's is
        broadcast).

        Raises:
            ValueError: wrong shapes.
        """
        state_io.write_state(self.state_pool, slot, conv, recurrent, self.config, self.tp)

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Hybrid models: copy state slot ``src_slot`` into ``dst_slot`` (prefix-cache snapshots; with TP every
        rank calls it)."""
        state_io.copy_slot(self.state_pool, src_slot, dst_slot)

    def state_handles(self) -> list[KVPoolHandle] | None:
        """Hybrid models with ``share_kv``: the handles of the state pool's conv and recurrent buffers (mapped
        like the KV pool's); else None."""
        if not self.share_kv or self.state_pool is None:
            return None
        pool = self.state_pool
        return [export_pool(pool.conv_buffer, pool.shm_paths[0]), export_pool(pool.recurrent_buffer,
                                                                              pool.shm_paths[1])]

    def copy_state_from(self, peer_conv: torch.Tensor, peer_recurrent: torch.Tensor, src_slot: int,
                        dst_slot: int) -> None:
        """Hybrid models: copy a mapped prefill state pool's slot into ``dst_slot`` (see
        :func:`~epdserve.engine.state_io.copy_state`; raises ValueError on a mismatch)."""
        state_io.copy_state(self.state_pool, peer_conv, peer_recurrent, src_slot, dst_slot)

    def close(self) -> None:
        """Release what the runner holds outside this process (nothing for one rank; TP runners stop their
        ranks)."""

    def release_graphs(self) -> None:
        """Drop the decode and prefill CUDA graphs once the device has run every queued kernel (no-op without
        graphs). A TP rank calls it before leaving its process group: an NCCL communicator is not destroyed while a
        captured graph still references it (see :mod:`epdserve.engine.shutdown`). The runner runs eagerly after."""
        if self.graphs is None and self.prefill_graphs is None:
            return
        import gc

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        self.graphs = self.prefill_graphs = None
        gc.collect()  # the graphs' executables are freed now, not at some later collection
        if cuda:
            torch.cuda.synchronize(self.device)

    def kv_handle(self) -> KVPoolHandle | None:
        """The handle another process of this machine maps this KV pool with, or None without ``share_kv``."""
        return export_pool(self.kv_pool.buffer, self.kv_pool.shm_path) if self.share_kv else None

    def copy_kv_from(self, peer: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy KV from a mapped peer pool ``peer`` ``[L, 2, peer_slots, H, D]`` (slot-indexed, see
        :class:`~epdserve.kvcache.kv_share.PeerPools`) at ``src_slots`` ``[n]`` into this pool's ``dst_slots``
        ``[n]``, queued on the current stream (device to device; across GPUs through peer access).

        Raises:
            ValueError: the peer's layers, heads, head size or dtype differ from this pool's.
        """
        pool = self.kv_pool
        if (peer.shape[0], *peer.shape[3:]) != (pool.num_layers, pool.num_kv_heads, pool.head_dim) \
                or peer.dtype != pool.dtype:
            raise ValueError(f"prefill KV pool {tuple(peer.shape)} {peer.dtype} does not match this pool "
                             f"({pool.num_layers} layers, {pool.num_kv_heads} KV heads, {pool.head_dim}, {pool.dtype})")
        with torch.no_grad():
            kv = peer[:, :, src_slots.to(peer.device, non_blocking=True)]
            pool.write_all(dst_slots.to(self.device, non_blocking=True), kv)

    def warmup(self, max_extend_tokens: int = 0) -> None:
        """Run one small prefill and one decode step on scratch pages, so kernel JIT builds (flashinfer) and CUDA
        initialisation happen before the server says it is ready, not inside the first request's TTFT. The
        scratch KV is never read by a request: each request writes its slots before attending to them. Its
        seconds (kernel builds included) go to :attr:`startup_s` as ``warm-up``.

        ``max_extend_tokens``: the most new tokens of one extend forward the server runs (a prefill server's
        ``--max-prefill-tokens``; 0 for a decode server, which runs none): hybrid models on CUDA also run extends
        of several requests up to that size, see :meth:`_warmup_varlen_extends`."""
        t0 = time.monotonic()
        n = min(8, self.page_size * self.num_pages - 1)
        pages = list(range(-(-(n + 1) // self.page_size)))
        positions = torch.arange(n + 1).expand(3, -1)
        slots = torch.arange(n + 1)
        ids = torch.zeros(n + 1, dtype=torch.int64)
        state = None if self.state_pool is None else [self.state_pool.scratch_slot]
        self.forward(ForwardBatch(False, ids[:n], positions[:, :n], slots[:n], [n], [n], [pages], state_slots=state))
        self.forward(ForwardBatch(True, ids[n:], positions[:, n:], slots[n:], [1], [n + 1], [pages],
                                  state_slots=state))
        if self.state_pool is not None and self.device.type == "cuda" and max_extend_tokens > 0:
            self._warmup_varlen_extends(max_extend_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_s["warm-up"] = time.monotonic() - t0

    def _warmup_varlen_extends(self, max_tokens: int) -> None:
        """Extends of the shapes served prefill batches take (one request or many, fresh or continued, short or
        past a 64-token chunk, and up to ``max_tokens`` tokens in all), so that fla's Triton kernels compile and
        autotune before the ready line, not while requests wait: fla's q/k L2 norm autotunes once per 65536 rows
        (tokens times key heads), which a 32-concurrent load first reached at ~4k tokens and stalled the prefill
        server for 11 s, long enough for the gateway to take it for down (H100, 9B, issue 42). On scratch state
        and the first pages, whose KV no request reads before writing it."""
        ps = self.page_size
        shapes = [([70, 5], 0), ([4] * 16, 0), ([1], 8), ([33, 1], 8), ([16], 0)]
        # Every 4096 tokens up to max_tokens: each autotune step of the L2 norm with up to 16 key heads per rank,
        # as batches of requests of at most 2048 tokens (the default --chunked-prefill-size).
        for total in sorted({*range(4096, max_tokens, 4096), max_tokens}):
            n = max(2, -(-total // 2048))
            shapes.append(([total // n] * n, 0))
        for q_lens, prefix in shapes:
            kv_lens = [q + prefix for q in q_lens]
            longest = max(kv_lens)
            pages = list(range(-(-longest // ps)))
            if len(pages) > self.num_pages:
                continue
            pos = torch.cat([torch.arange(prefix, kv) for kv in kv_lens])
            T = len(pos)
            self.forward(ForwardBatch(False, torch.zeros(T, dtype=torch.int64), pos.expand(3, -1), pos.clone(),
                                      q_lens, kv_lens, [pages] * len(q_lens),
                                      state_slots=[self.state_pool.scratch_slot] * len(q_lens)))


def build_runner(cfg, model_path: str, tp: TPGroup, cuda_graph_max_bs: int = 0,
                 share_kv: bool = False) -> ModelRunner:
    """Build and warm up TP rank ``tp.rank``'s model runner of a prefill or decode server from its
    :class:`~epdserve.config.LMServerConfig` (every rank calls this with the same ``cfg``; its collectives pair
    up across ranks), with decode CUDA graphs up to ``cuda_graph_max_bs`` (0: none) and, for a prefill server,
    prefill CUDA graphs up to its ``cuda_graph_max_tokens``.

    Raises:
        ValueError: unknown dtype or attention backend, heads that do not split over the ranks.
    """
    from epdserve.device import limit_cpu_threads, resolve_dtype

    limit_cpu_threads(tp.device)
    runner = ModelRunner(model_path, device=tp.device, dtype=resolve_dtype(cfg.dtype, tp.device),
                         num_pages=cfg.num_pages, page_size=cfg.page_size, attention_backend=cfg.attention_backend,
                         decode_attention_backend=cfg.decode_attention_backend,
                         mem_fraction=cfg.mem_fraction, cuda_graph_max_bs=cuda_graph_max_bs,
                         prefill_graph_max_tokens=getattr(cfg, "cuda_graph_max_tokens", 0), share_kv=share_kv, tp=tp,
                         # decode: one state slot per running request; prefill: the default plus its prefix-cache
                         # snapshots
                         num_state_slots=getattr(cfg, "max_running_requests", DEFAULT_STATE_SLOTS)
                         + getattr(cfg, "state_snapshot_slots", 0))
    runner.warmup(getattr(cfg, "max_prefill_tokens", 0))
    return runner
