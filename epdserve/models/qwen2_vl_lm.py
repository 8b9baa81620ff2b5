"""epdserve's own Qwen2 decoder LM with M-RoPE: the text half of Qwen2-VL / Qwen2.5-VL.

Architecture: Qwen2 (RMSNorm pre-norm blocks, GQA attention with q/k/v bias, SiLU-gated MLP) as in transformers'
``Qwen2_5_VLTextModel``; M-RoPE from the Qwen2-VL paper (arXiv:2409.12191) and transformers'
``Qwen2_5_VLRotaryEmbedding`` + ``apply_multimodal_rotary_pos_emb`` (rotate-half style). Attention goes through an
:class:`~epdserve.attention.base.AttentionBackend`, which owns the paged KV cache.

Two implementations of the small operations (norms, residual adds, RoPE, SiLU-and-mul), chosen per model:
- torch (``fused_ops=False``, CPU and the reference): the exact arithmetic of transformers, so CPU outputs match
  ``generate()`` token for token.
- fused kernels (``fused_ops=True``, CUDA): flashinfer's ``fused_add_rmsnorm`` (residual add + RMSNorm in one
  pass) and ``silu_and_mul``, as SGLang's Qwen2 uses them (up to 64 rows, a decode batch, the gate_up projection
  and SiLU-and-mul are one Triton kernel instead, :mod:`epdserve.models.gate_up_silu`), and RoPE in place
  (:mod:`epdserve.models.rope_inplace`, flashinfer's ``apply_rope_with_cos_sin_cache_inplace`` arithmetic in a
  Triton kernel that compiles in a second where flashinfer's takes ~27 s on a fresh machine), which also writes K
  and V into the KV cache where the backend allows it (:func:`rope_and_kv_write`). Decode batches of at most 4 rows
  run qkv and o_proj as :mod:`epdserve.models.decode_gemv` GEMVs (hidden size up to 2048), and at one row fold both
  add + RMSNorm kernels into the qkv GEMV and the gate_up + SiLU kernel (:meth:`DecoderLayer.forward`). A decode
  step of a 36-layer model launched ~39 kernels per layer with torch ops, ~2-3 us each on the GPU even inside a
  CUDA graph; fused, it launches ~11. They round differently from transformers (RMSNorm multiplies by the weight
  in float32), so GPU outputs are close to, not bit-equal with, the CPU reference.

Tensor parallelism (:mod:`epdserve.models.parallel`): attention heads and the MLP's intermediate features are split
over the TP ranks of ``tp`` (q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel with one
all-reduce each), the embedding and the LM head over the vocabulary. With one rank the layers are the plain ones.

M-RoPE through the fused RoPE kernel: it reads this forward's own per-token M-RoPE cos|sin table (``[T, head_dim]``
float32), so one kernel serves text and image positions alike.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from epdserve.attention.base import AttentionBackend
from epdserve.engine.distributed import TPGroup
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.models import decode_gemv, decode_qkv, gate_up_silu
from epdserve.models.config import ModelConfig
from epdserve.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                      VocabParallelEmbedding, head_shard, split_evenly)
from epdserve.models.rope_inplace import rope_inplace


def _flashinfer():
    import flashinfer  # imported on first use: only CUDA models with fused ops need it

    return flashinfer


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers' ``Qwen2RMSNorm``; optionally fused with the
    residual add before it (``residual`` given), as vLLM/SGLang's ``RMSNorm.forward(x, residual)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.fused = eps, False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x`` ``[T, dim]`` -> ``norm(x)``; with ``residual`` ``[T, dim]``: ``(norm(x + residual), x + residual)``.
        Fused: ``x`` and ``residual`` overwritten (flashinfer ``fused_add_rmsnorm``), or ``x`` split-K parts
        ``[S, T, dim]`` summed (:func:`~epdserve.models.decode_gemv.norm_parts`; unfused: ``merge_parts``)."""
        if self.fused:
            if residual is None:
                return _flashinfer().norm.rmsnorm(x, self.weight, self.eps)
            if x.dim() == 3:
                return decode_gemv.norm_parts(x, residual, self.weight, self.eps, residual_out=True)
            _flashinfer().norm.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual = decode_gemv.merge_parts(x, residual.dtype) + residual
            x = residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int],
                  dtype: torch.dtype, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, head_dim]`` (``dtype``) for int64 positions ``[3, T]`` and float32 ``inv_freq``
    ``[head_dim / 2]``: each rotary frequency takes its angle from one axis (t, h, w) as :func:`_mrope_angles`
    assigns it, then the half is duplicated for rotate-half."""
    freqs = _mrope_angles(positions, inv_freq, section, interleaved)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _mrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int],
                  interleaved: bool = False) -> torch.Tensor:
    """float32 ``[T, head_dim / 2]`` rotary angles of positions ``[3, T]``.

    Chunked (Qwen2-VL / Qwen2.5-VL, transformers' ``apply_multimodal_rotary_pos_emb``): frequency band ``i`` of the
    ``section`` split takes axis ``i % 3``. Interleaved (Qwen3-VL, transformers'
    ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``): frequency ``j`` takes h when ``j % 3 == 1`` and
    ``j < 3 * section[1]``, w when ``j % 3 == 2`` and ``j < 3 * section[2]``, t otherwise, so every axis spans
    the whole frequency range.
    """
    freqs = positions[..., None].float() * inv_freq.float()  # [3, T, D/2]
    if interleaved:
        out = freqs[0].clone()
        for axis in (1, 2):
            band = slice(axis, 3 * section[axis], 3)
            out[..., band] = freqs[axis, ..., band]
        return out
    return torch.cat([chunk[i % 3] for i, chunk in enumerate(freqs.split(list(section), dim=-1))], dim=-1)


def mrope_cos_sin_table(positions: torch.Tensor, inv_freq: torch.Tensor,
                        section: tuple[int, int, int], interleaved: bool = False) -> torch.Tensor:
    """The same angles as :func:`mrope_cos_sin` as one float32 ``[T, head_dim]`` table, ``cos`` of the
    ``head_dim / 2`` frequencies then their ``sin``: the table :func:`~epdserve.models.rope_inplace.rope_inplace`
    reads."""
    freqs = _mrope_angles(positions, inv_freq, section, interleaved)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, table: torch.Tensor,
                      attn: AttentionBackend, layer_id: int) -> bool:
    """RoPE in place on ``q``/``k`` (``[T, heads * head_dim]`` views; see
    :func:`~epdserve.models.rope_inplace.rope_inplace`), storing ``k`` and ``v`` in the KV cache in the same launch
    where the backend lets the caller write them (:meth:`~epdserve.attention.base.AttentionBackend.kv_write`) and
    the pool holds ``k``'s dtype. Returns whether it stored them (pass it to ``attn.forward`` as ``kv_written``)."""
    target = attn.kv_write(layer_id, k.dtype)
    rope_inplace(q, k, head_dim, table, v=v, kv_write=target)
    return target is not None


@dataclass
class _Rope:
    """One forward's rotary angles: ``cos``/``sin`` ``[T, 1, D]`` (torch ops) or ``table`` ``[T, D]`` float32, cos
    in the first half and sin in the second (the fused kernels)."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    table: torch.Tensor | None = None


class Attention(nn.Module):
    """GQA self-attention over this TP rank's heads (``hq`` query, ``hkv`` KV heads; see
    :func:`~epdserve.models.parallel.head_shard`); q/k/v are one fused projection (with bias unless ``qkv_bias``
    is False), o_proj has none."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, qkv_bias: bool = True):
        super().__init__()
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp)
        self.layer_id, self.hq, self.hkv, self.d = layer_id, heads.num_heads, heads.num_kv_heads, cfg.head_dim
        d = self.d
        kv_part = (cfg.num_kv_heads * d, heads.kv_start * d, self.hkv * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [(cfg.num_heads * d, heads.q_start * d, self.hq * d), kv_part, kv_part], bias=qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, rope: _Rope, attn: AttentionBackend, parts: bool = False) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (``parts``: as :meth:`attend_rotated`)."""
        return self.attend(self.qkv_proj(x), rope, attn, parts)

    rope_on_projection = True  # RoPE on q, k as projected: one kernel may do both (decode_qkv); Qwen3 norms first

    def attend(self, qkv: torch.Tensor, rope: _Rope, attn: AttentionBackend, parts: bool = False) -> torch.Tensor:
        """After the qkv projection: ``qkv`` ``[T, (hq + 2 hkv) * d]`` -> ``[T, hidden]`` (``parts``: as below)."""
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        if rope.table is not None:  # in place on the strided views of the qkv output: no copies
            written = rope_and_kv_write(q, k, v, self.d, rope.table, attn, self.layer_id)
            return self.attend_rotated(qkv, attn, written, parts)
        q = _rotate(q.view(-1, self.hq, self.d), rope.cos, rope.sin)
        k = _rotate(k.view(-1, self.hkv, self.d), rope.cos, rope.sin)
        out = attn.forward(self.layer_id, q, k, v.view(-1, self.hkv, self.d))
        return self.o_proj(out.reshape(-1, self.hq * self.d), parts=parts)

    def attend_rotated(self, qkv: torch.Tensor, attn: AttentionBackend, kv_written: bool, parts=False,
                       early_kv=False) -> torch.Tensor:
        """:meth:`attend` once q and k in ``qkv`` are rotated (``kv_written``: and K and V are in the KV cache);
        ``parts``: o_proj may return split-K parts (:meth:`~epdserve.models.parallel.RowParallelLinear.forward`);
        ``early_kv``: see :meth:`~epdserve.attention.base.AttentionBackend.forward`."""
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        out = attn.forward(self.layer_id, q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d),
                           v.view(-1, self.hkv, self.d), kv_written=kv_written, early_kv=early_kv)
        return self.o_proj(out.reshape(-1, self.hq * self.d), parts=parts)


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection; the intermediate features
    (``intermediate``, default ``cfg.intermediate_size``; a shared expert's own size) are split over the TP ranks."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate: int | None = None):
        super().__init__()
        inter = cfg.intermediate_size if intermediate is None else intermediate
        start, local = split_evenly(inter, tp, "intermediate size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [(inter, start, local)] * 2, bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp)
        # parts_out: the owner's next kernel sums split-K parts (DecoderLayer's next norm), so down may make them
        self.fused, self.parts_out = False, False

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (``reduce`` False: this TP rank's partial sum; with ``parts_out``
        maybe split-K parts ``[S, T, hidden]``: see :meth:`RowParallelLinear.forward`)."""
        if self.fused and x.shape[0] <= gate_up_silu.MAX_M:  # decode-sized: projection and SiLU in one kernel
            act = gate_up_silu.gate_up_silu(x, self.gate_up_proj.weight, *gate_up_silu.config_for(x.shape[0]))
            return self.down_proj(act, reduce, self.parts_out)
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(_flashinfer().activation.silu_and_mul(gate_up), reduce, self.parts_out)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up, reduce)

    def forward_with_norm(self, x: torch.Tensor, residual: torch.Tensor,
                          norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode row's ``(mlp(norm(x + residual)), x + residual)`` with the add + RMSNorm inside the gate_up +
        SiLU kernel; without TP the output is the down projection's split-K parts ``[S, 1, hidden]``
        (:func:`~epdserve.models.decode_gemv.down_parts`), which the next block's norm sums."""
        act, residual = gate_up_silu.norm_gate_up_silu(x, self.gate_up_proj.weight, norm.weight, norm.eps, residual,
                                                       *gate_up_silu.config_for(x.shape[0]))
        if self.down_proj.tp.size == 1:
            return decode_gemv.down_parts(act, self.down_proj.weight), residual
        return self.down_proj(act), residual


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``; ``attention_cls`` builds ``self_attn``
    (:class:`Attention`, or a subclass such as Qwen3's with q/k norms)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, attention_cls: type[Attention] = Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)
        self.mlp.parts_out = True  # the next block's norm, or the model's last, sums them

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: _Rope,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` ``[T, hidden]`` each -> the same after this block; the block's output is
        ``x + residual`` (kept apart so the next norm can fuse the add). ``residual`` None: first block."""
        if self._norms_in_projections(x):
            return self._forward_norms_in_projections(x, residual, rope, attn)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, attn, parts=self.post_attention_layernorm.fused)  # o's parts: the norm sums
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _norms_in_projections(self, x: torch.Tensor) -> bool:
        """Whether this forward folds both norms into the projections after them (fused ops, a dense MLP, a
        decode batch of at most :data:`decode_gemv.FOLD_NORMS_MAX_M` rows): see :mod:`epdserve.models.decode_gemv`."""
        takes_norm = hasattr(self.mlp, "forward_with_norm")  # the dense MLP, an MoE block
        # x in split-K parts [S, T, K] (either path's down projection; either norm sums them): a row of K it fits
        fits = x.shape[-1] <= decode_gemv.MAX_K if x.dim() == 3 else decode_gemv.fits(x, self.self_attn.qkv_proj.weight)
        return (self.input_layernorm.fused and takes_norm and getattr(self.mlp, "fused", True)
                and x.shape[-2] <= decode_gemv.FOLD_NORMS_MAX_M and fits)

    def _forward_norms_in_projections(self, x: torch.Tensor, residual: torch.Tensor | None, rope: _Rope,
                                      attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with each add + RMSNorm inside the projection after it: the qkv GEMV (with RoPE and the
        KV write where :mod:`~epdserve.models.decode_qkv` applies), then the MLP's ``forward_with_norm`` (the dense
        one's output may be split-K parts, which the next norm sums, the model's final norm too)."""
        ln1, ln2, sa = self.input_layernorm, self.post_attention_layernorm, self.self_attn
        w, b = sa.qkv_proj.weight, sa.qkv_proj.bias
        parts = getattr(self.mlp, "takes_parts", False)  # o_proj may hand split-K parts to the MLP's norm
        if rope.table is not None and sa.rope_on_projection and decode_qkv.fits(x, w, sa.d):
            target = attn.kv_write(sa.layer_id, w.dtype)
            qkv, residual = decode_qkv.norm_qkv_rope(x, w, b, ln1.weight, ln1.eps, residual, sa.d, sa.hq, sa.hkv,
                                                     rope.table, target)
            x = sa.attend_rotated(qkv, attn, target is not None, parts, early_kv=target is not None)  # (PDL)
        else:
            qkv, residual = decode_gemv.norm_gemv(x, w, b, ln1.weight, ln1.eps, residual)
            x = sa.attend(qkv, rope, attn, parts)
        return self.mlp.forward_with_norm(x, residual, ln2)


# Checkpoint projection names -> (fused parameter, index of the part within it).
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Qwen2VLLanguageModel(nn.Module):
    """The Qwen2-VL / Qwen2.5-VL text decoder over a paged KV cache.

    ``attn`` (an :class:`AttentionBackend`) must be set before :meth:`forward`; it is a plain attribute, not a
    submodule, so moving the model between devices never touches the KV pool.

    ``tp`` (default: one rank) is this process's TP group; every rank builds the model with its own group and
    runs every forward, in the same order (the layers' collectives pair up across ranks).

    Raises:
        ValueError: heads, KV heads or the intermediate size cannot be split over ``tp.size`` ranks.
    """

    _attention_cls: type[Attention] = Attention  # a subclass's decoder layers may use another attention
    fused_parts = FUSED_PARTS  # checkpoint names filling parts of one fused parameter (load_weights)

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend | None = None, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.config, self.attn, self.fused_ops = cfg, attn, False
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, self._attention_cls) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", self._inv_freq(cfg), persistent=False)

    @staticmethod
    def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
        # On the CPU even inside the meta-device build: a meta arange imports torch's Python reference ops.
        steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device="cpu")
        return 1.0 / (cfg.rope_theta ** (steps / cfg.head_dim))

    def materialize(self, device: torch.device, dtype: torch.dtype) -> Qwen2VLLanguageModel:
        """Give a model built on the meta device real (uninitialised) ``dtype`` storage on ``device``, re-tie
        lm_head to embed_tokens (new storage unties them) and rebuild the float32 RoPE table. Floating tensors take
        ``dtype``, the others keep theirs. Returns self."""
        # One torch.empty per tensor rather than Module.to_empty: the latter's empty_like on meta tensors runs
        # torch's Python reference ops, whose first use imports torch._refs and torch._prims (0.5-1.5 s of every
        # start-up, measured on the CPU).
        for module in self.modules():
            for slots in (module._parameters, module._buffers):
                for name, t in slots.items():
                    if t is None:
                        continue
                    empty = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                    slots[name] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = self._inv_freq(self.config).to(device)
        return self

    def use_fused_ops(self, enabled: bool) -> Qwen2VLLanguageModel:
        """Switch norms, SiLU-and-mul and RoPE to flashinfer's fused CUDA kernels (see the module docstring).
        Returns self. Raises ImportError when enabled and flashinfer is not installed."""
        if enabled:
            _flashinfer()
        self.fused_ops = enabled
        for m in self.modules():
            if isinstance(m, (RMSNorm, MLP, ColumnParallelLinear, RowParallelLinear)):
                m.fused = enabled
        return self

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(lm_name, tensor)`` pairs (see :func:`epdserve.models.weights.iter_lm_weights`) into the
        parameters, filling the fused ``qkv_proj``/``gate_up_proj`` from their parts. Tensors are full checkpoint
        tensors; a sharded layer keeps this TP rank's slice (``load_shard``).

        Raises:
            ValueError: an unknown name, a shape mismatch, or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        parts_done: dict[str, int] = {}
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # shares embed_tokens' parameter
            target, part = name, None
            for piece, (fused_name, idx) in self.fused_parts.items():
                if f".{piece}." in name:
                    target, part = name.replace(f".{piece}.", f".{fused_name}."), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the LM")
            module = modules[target.rpartition(".")[0]]
            if part is not None:
                parts_done[target] = parts_done.get(target, 0) + 1
            if hasattr(module, "load_shard"):
                try:
                    module.load_shard(param, tensor, part)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
            elif param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
            loaded.add(target)
        missing = [n for n in params if n not in loaded]
        parts_of = collections.Counter(fused for fused, _ in self.fused_parts.values())
        partial = [n for n, c in parts_done.items() if c != parts_of[n.rpartition(".")[0].rpartition(".")[2]]]
        if missing or partial:
            raise ValueError(f"checkpoint lacks LM tensors: {sorted(missing + partial)[:8]}")

    def forward(self, batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``batch`` (tensors on the model's device) and return float32 logits ``[B, vocab]`` at each
        request's last new token; ``lm_head`` runs on those B rows only. With ``out`` (float32 ``[B, vocab]``) the
        logits are written there (see :meth:`ParallelLMHead.forward`) and ``out`` is returned.

        The attention backend must have been prepared for ``batch`` (``attn.prepare(batch)``): the model runner
        does it, outside the CUDA graph when one replays this forward. A decode batch makes no host-to-device
        copy here, so it can be captured in a CUDA graph.

        Rows where ``batch.mm_mask`` is True take ``batch.mm_embeds`` (cast to the model dtype; packed or aligned,
        see :class:`ForwardBatch`) instead of the token embedding. A prefill batch with ``last_rows`` makes no
        host-to-device copy either (the prefill CUDA graphs, :mod:`epdserve.engine.prefill_graph`).

        Raises:
            RuntimeError: no attention backend set, or ``mm_embeds`` row count != ``mm_mask.sum()``.
        """
        if self.attn is None:
            raise RuntimeError(f"{type(self).__name__}.attn is not set")
        x = self._embed(batch)
        rope = self._rope(batch, x)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, self.attn)
        return self._logits(batch, x, residual, out)

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        """``[T, hidden]`` token embeddings, ``batch.mm_embeds`` spliced in where ``batch.mm_mask`` is True."""
        x = self.embed_tokens(batch.input_ids)
        if batch.mm_mask is not None and batch.mm_embeds is not None:
            if batch.mm_embeds.shape[0] == x.shape[0]:  # aligned rows: no data-dependent shape, graph-safe
                x = torch.where(batch.mm_mask[:, None], batch.mm_embeds.to(x.dtype), x)
            else:
                x[batch.mm_mask] = batch.mm_embeds.to(x.dtype)
        return x

    def _rope(self, batch: ForwardBatch, x: torch.Tensor) -> _Rope:
        """This forward's rotary angles for ``batch.positions``, in the form the attention implementation takes."""
        section, interleaved = self.config.mrope_section, self.config.mrope_interleaved
        if self.fused_ops:
            return _Rope(table=mrope_cos_sin_table(batch.positions, self.inv_freq, section, interleaved))
        return _Rope(*mrope_cos_sin(batch.positions, self.inv_freq, section, x.dtype, interleaved))

    def _logits(self, batch: ForwardBatch, x: torch.Tensor, residual: torch.Tensor | None,
                out: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head on each request's last row of the last block's ``(x, residual)`` (``residual``
        None: ``x`` is the whole hidden state); see :meth:`forward` for ``out``."""
        if residual is not None and not self.norm.fused:  # the fused norm sums decode's split-K parts itself
            x = decode_gemv.merge_parts(x, residual.dtype)
        if not batch.is_decode:  # decode has one new token per request: every row is a last row
            last = batch.last_rows
            if last is None:
                last = torch.tensor(batch.q_lens, device=x.device).cumsum(0) - 1
            x, residual = x[..., last, :], None if residual is None else residual[last]  # x: maybe parts
        x = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return self.lm_head(x).float() if out is None else self.lm_head(x, out)
