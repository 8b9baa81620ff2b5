"""The LM half of a prefill or decode server: weights, paged KV pool and attention backend behind one forward."""

from __future__ import annotations

import dataclasses

import torch

from epdserve.attention.base import make_backend
from epdserve.forward_batch import ForwardBatch
from epdserve.kvcache.kv_pool import KVPool
from epdserve.kvcache.kv_share import export_pool, new_shm_path
from epdserve.messages import KVPoolHandle
from epdserve.models.config import ModelConfig
from epdserve.models.qwen2_vl_lm import Qwen2VLLanguageModel
from epdserve.models.weights import iter_lm_weights

_CPU_DEFAULT_PAGES = 4096


class ModelRunner:
    """Loads a Qwen2-VL / Qwen2.5-VL language model and runs :class:`ForwardBatch` es over its paged KV cache.

    Attributes: ``config`` (:class:`ModelConfig`), ``num_pages``, ``page_size``, ``device``, ``dtype``,
    ``kv_pool`` (:class:`KVPool`), ``model`` (:class:`Qwen2VLLanguageModel`), ``backend``.
    """

    def __init__(self, model_path: str, *, device: torch.device, dtype: torch.dtype, num_pages: int,
                 page_size: int, attention_backend: str = "auto", mem_fraction: float = 0.5,
                 cuda_graph_max_bs: int = 0, share_kv: bool = False):
        """Load config and LM weights (vision weights are skipped), then size and allocate the KV pool.

        ``num_pages == 0`` sizes the pool automatically: on CUDA ``mem_fraction`` of the free memory left after
        loading the weights, on CPU 4096 pages. The pool holds one more page than ``num_pages``: the scratch page
        that CUDA-graph padding rows write to; pages ``0 .. num_pages - 1`` are the schedulers'.

        With the flashinfer backend the model uses flashinfer's fused norm/RoPE/activation kernels, and
        ``cuda_graph_max_bs > 0`` captures decode CUDA graphs up to that batch size (see
        :mod:`epdserve.cuda_graph`); the graphs need the flashinfer backend and are skipped otherwise.

        ``share_kv`` makes the KV pool mappable by other processes of this machine (:meth:`kv_handle`): on CUDA
        every pool is; on the CPU the pool is then allocated in a /dev/shm file.

        Raises:
            FileNotFoundError: missing config or weights.
            ValueError: unsupported model, bad weights, bad backend name, or no room for one page.
        """
        self.device, self.dtype, self.page_size = torch.device(device), dtype, page_size
        self.config = cfg = ModelConfig.load(model_path)
        # Built on the meta device so no memory is spent on random init; the weights fill it in place.
        with torch.device("meta"):
            model = Qwen2VLLanguageModel(cfg)
        model.materialize(self.device, dtype)
        weights = iter_lm_weights(model_path, tie_word_embeddings=cfg.tie_word_embeddings, device=self.device)
        model.load_weights((name, t.to(dtype)) for name, t in weights)
        self.model = model.eval().requires_grad_(False)
        if num_pages <= 0:
            num_pages = self._auto_pages(mem_fraction)
        self.num_pages = num_pages
        self.share_kv = share_kv
        self.kv_pool = KVPool(num_layers=cfg.num_layers, num_pages=num_pages + 1, page_size=page_size,
                              num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=self.device,
                              shm_path=new_shm_path() if share_kv and self.device.type == "cpu" else "")
        self.backend = make_backend(attention_backend, self.kv_pool, cfg.num_heads)
        self.model.attn = self.backend
        self.model.use_fused_ops(self.backend.uses_flashinfer)
        self.graphs = None
        if cuda_graph_max_bs > 0 and self.backend.uses_flashinfer:
            from epdserve.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self.model, self.backend, vocab_size=cfg.vocab_size,
                                          max_bs=cuda_graph_max_bs, scratch_page=num_pages, page_size=page_size)

    def _auto_pages(self, mem_fraction: float) -> int:
        if self.device.type != "cuda":
            return _CPU_DEFAULT_PAGES
        free, _ = torch.cuda.mem_get_info(self.device)
        cfg = self.config
        per_page = KVPool.bytes_per_page(num_layers=cfg.num_layers, page_size=self.page_size,
                                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=self.dtype)
        pages = int(free * mem_fraction) // per_page
        if pages < 1:
            raise ValueError(f"no room for a KV page: {free} bytes free, {per_page} bytes per page")
        return pages

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` (tensors on any device; moved here) and return float32 logits ``[B, vocab]`` at each
        request's last new token. New K/V land in ``batch.out_slots``. Decode batches that a CUDA graph covers
        are replayed (their logits are a view valid until the next forward); the rest run eagerly.

        Raises:
            ValueError: inconsistent page tables / lengths (from the attention backend).
        """
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.replay(batch)
        dev = self.device
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
        model dtype (the :class:`~epdserve.messages.KVTransfer` payload)."""
        with torch.no_grad():
            return self.kv_pool.read(slots.to(self.device)).to("cpu").contiguous()

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store a received ``kv`` ``[num_layers, 2, n, num_kv_heads, head_dim]`` at ``slots`` ``[n]``.

        Raises:
            ValueError: ``kv`` has the wrong shape.
        """
        with torch.no_grad():
            self.kv_pool.write_all(slots.to(self.device), kv)

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

    def warmup(self) -> None:
        """Run one small prefill and one decode step on scratch pages, so kernel JIT builds (flashinfer) and CUDA
        initialisation happen before the server says it is ready, not inside the first request's TTFT. The
        scratch KV is never read by a request: each request writes its slots before attending to them."""
        n = min(8, self.page_size * self.num_pages - 1)
        pages = list(range(-(-(n + 1) // self.page_size)))
        positions = torch.arange(n + 1).expand(3, -1)
        slots = torch.arange(n + 1)
        ids = torch.zeros(n + 1, dtype=torch.int64)
        self.forward(ForwardBatch(False, ids[:n], positions[:, :n], slots[:n], [n], [n], [pages]))
        self.forward(ForwardBatch(True, ids[n:], positions[:, n:], slots[n:], [1], [n + 1], [pages]))


def runner_from_config(cfg, cuda_graph_max_bs: int = 0, share_kv: bool = False) -> tuple[str, ModelRunner, int]:
    """Build and warm up the model runner of a prefill or decode server from its
    :class:`~epdserve.config.LMServerConfig`, with decode CUDA graphs up to ``cuda_graph_max_bs`` (0: none).
    Returns ``(model_path, runner, context_length)``.

    ``share_kv``: see :class:`ModelRunner`.

    Raises:
        FileNotFoundError: ``cfg.model_path`` is not a local checkpoint.
        ValueError: unknown device, dtype or attention backend.
    """
    from epdserve.device import resolve_device, resolve_dtype
    from epdserve.models.tiny import resolve_model_path

    model_path = resolve_model_path(cfg.model_path)
    device = resolve_device(cfg.device)
    runner = ModelRunner(model_path, device=device, dtype=resolve_dtype(cfg.dtype, device), num_pages=cfg.num_pages,
                         page_size=cfg.page_size, attention_backend=cfg.attention_backend,
                         mem_fraction=cfg.mem_fraction, cuda_graph_max_bs=cuda_graph_max_bs,
                         share_kv=share_kv)
    runner.warmup()
    return model_path, runner, cfg.context_length or runner.config.max_position_embeddings
