"""epdserve's own Qwen3 decoder LM with interleaved M-RoPE and DeepStack: the text half of Qwen3-VL (dense).

Reference: transformers 5 ``models/qwen3_vl/modeling_qwen3_vl.py`` (``Qwen3VLTextModel``,
``Qwen3VLTextAttention``, ``Qwen3VLTextRotaryEmbedding``); DeepStack from Meng et al., arXiv:2406.04334.

What differs from the Qwen2 decoder of :mod:`epdserve.models.qwen2_vl_lm`, whose layers, norms, TP sharding,
paged attention and fused-op switch this module reuses:

- Attention: no q/k/v bias, and a per-head RMSNorm over ``head_dim`` on q and on k before RoPE
  (``q_norm``/``k_norm``, one ``[head_dim]`` weight shared by all heads, so TP shards need no slicing of them).
  ``head_dim`` is the config's, which may differ from hidden / heads (Qwen3-VL-4B: 2560 / 32 heads, 128).
- M-RoPE is interleaved (t, h, w, t, h, w, ... over the frequencies; see
  :func:`~epdserve.models.qwen2_vl_lm.mrope_cos_sin`), the ``mrope_interleaved`` of :class:`ModelConfig`.
- DeepStack: after decoder layer ``i < L`` the i-th level of ``batch.deepstack_embeds`` (features of intermediate
  vision blocks, one ``[N, hidden]`` per level) is added to the hidden states of the image-token rows, as
  ``Qwen3VLTextModel._deepstack_process`` does. The encoder sends the levels as extra columns of each image row
  (``mm_embeds`` ``[N, hidden * (1 + L)]``, vLLM's layout); :meth:`Qwen3VLLanguageModel.forward` splits them.

CUDA: the fused ops apply as for Qwen2 (flashinfer), and q/k norms with RoPE run as one Triton kernel
(:mod:`epdserve.models.qk_norm_rope`). Decode batches carry no image rows, so decode CUDA graphs apply
unchanged. The prefill CUDA graphs (:mod:`epdserve.engine.prefill_graph`) hold aligned rows of ``embed_width``
columns, so the DeepStack levels come in as aligned views and are added with ``torch.where`` (no data-dependent
shape). An eager packed prefill finds the image rows once per forward (one host sync) and adds every level with
``index_add_``.
"""

from __future__ import annotations

import dataclasses

import torch

from epdserve.engine.distributed import TPGroup
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.models import decode_gemv
from epdserve.models.config import ModelConfig
from epdserve.models.qk_norm_rope import qk_norm_rope
from epdserve.models.qwen2_vl_lm import Attention, Qwen2VLLanguageModel, RMSNorm, _Rope, _rotate, rope_and_kv_write


class Qwen3Attention(Attention):
    """GQA self-attention of Qwen3: :class:`~epdserve.models.qwen2_vl_lm.Attention` without q/k/v bias, with
    per-head RMSNorm of q and k (weights ``[head_dim]``) between the projection and RoPE."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__(cfg, layer_id, tp, qkv_bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    rope_on_projection = False  # the q/k norms come between the projection and RoPE

    def attend(self, qkv: torch.Tensor, rope: _Rope, attn, parts: bool = False) -> torch.Tensor:
        """The block after the qkv projection: ``qkv`` ``[T, (hq + 2 hkv) * head_dim]`` -> ``[T, hidden]`` (``parts``:
        as :meth:`~epdserve.models.qwen2_vl_lm.Attention.attend`)."""
        if rope.table is not None and self.q_norm.fused:  # CUDA: norms and RoPE in one kernel
            target = attn.kv_write(self.layer_id, qkv.dtype)
            q, k = qk_norm_rope(qkv, self.hq, self.hkv, self.d, self.q_norm.weight, self.k_norm.weight,
                                self.q_norm.eps, rope.table, kv_write=target)
            v = qkv[:, (self.hq + self.hkv) * self.d:]
            out = attn.forward(self.layer_id, q, k, v.view(-1, self.hkv, self.d), kv_written=target is not None)
            return self.o_proj(out.reshape(-1, self.hq * self.d), parts=parts)
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        # One row per head: the norm is over head_dim (what flashinfer's 2-D rmsnorm takes, too).
        q = self.q_norm(q.reshape(-1, self.d)).view(-1, self.hq * self.d)
        k = self.k_norm(k.reshape(-1, self.d)).view(-1, self.hkv * self.d)
        written = False
        if rope.table is not None:  # q and k are fresh contiguous tensors here: rotate them in place
            written = rope_and_kv_write(q, k, v, self.d, rope.table, attn, self.layer_id)
            q, k = q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d)
        else:
            q = _rotate(q.view(-1, self.hq, self.d), rope.cos, rope.sin)
            k = _rotate(k.view(-1, self.hkv, self.d), rope.cos, rope.sin)
        out = attn.forward(self.layer_id, q, k, v.view(-1, self.hkv, self.d), kv_written=written)
        return self.o_proj(out.reshape(-1, self.hq * self.d), parts=parts)


def add_deepstack(hidden: torch.Tensor, mask: torch.Tensor, features: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden`` ``[T, hidden]`` with ``features`` added to the rows where ``mask`` (``[T]`` bool) is True.

    ``features`` is ``[N, hidden]`` with ``N == mask.sum()`` (packed, rows in order) or ``[T, hidden]`` (aligned;
    rows outside the mask ignored, no data-dependent shape), any float dtype (cast to ``hidden``'s). ``rows``
    (int64 ``[N]``, ``mask.nonzero()``) spares a packed add the host sync of finding them. The sum per row is the
    one of transformers' ``Qwen3VLTextModel._deepstack_process`` (``hidden[mask] + features``, one rounding per
    element), so the result is bit-identical. Returns a new tensor for aligned features; packed ones are added
    into ``hidden``.
    """
    features = features.to(hidden.dtype)
    if features.shape[0] == hidden.shape[0]:
        return torch.where(mask[:, None], hidden + features, hidden)
    rows = mask.nonzero().squeeze(1) if rows is None else rows
    return hidden.index_add_(0, rows, features)


class Qwen3VLLanguageModel(Qwen2VLLanguageModel):
    """The Qwen3-VL (dense) text decoder over a paged KV cache: the interface of
    :class:`~epdserve.models.qwen2_vl_lm.Qwen2VLLanguageModel` (constructor ``(cfg, attn=None, tp=None)``,
    :meth:`materialize`, :meth:`use_fused_ops`, :meth:`load_weights`, :meth:`forward`) with Qwen3 attention,
    interleaved M-RoPE and DeepStack (see the module docstring).

    ``load_weights`` takes the names of :func:`epdserve.models.weights.iter_lm_weights` (``layers.N.self_attn.
    q_norm.weight`` and ``k_norm.weight`` besides Qwen2's, no q/k/v biases).

    Raises:
        ValueError: heads, KV heads or the intermediate size cannot be split over ``tp.size`` ranks.
    """

    _attention_cls = Qwen3Attention

    def forward(self, batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``batch`` and return float32 logits ``[B, vocab]`` at each request's last new token, as
        :meth:`Qwen2VLLanguageModel.forward` does; after decoder layer ``i`` for ``i < L``, level ``i`` of
        ``batch.deepstack_embeds`` (``[L, N or T, hidden]``, see :class:`ForwardBatch`) is added to the rows under
        ``batch.mm_mask``. Levels past the model's layer count are ignored, as in transformers.

        Raises:
            RuntimeError: no attention backend set.
            ValueError: ``mm_embeds`` rows given without ``deepstack_embeds`` (the model would silently differ
                from Qwen3-VL), or ``deepstack_embeds`` rows not matching ``mm_embeds``'.
        """
        if self.attn is None:
            raise RuntimeError(f"{type(self).__name__}.attn is not set")
        batch = self._split_columns(batch)
        deepstack = self._deepstack(batch)
        packed = len(deepstack) and deepstack.shape[1] != batch.mm_mask.shape[0]
        rows = batch.mm_mask.nonzero().squeeze(1) if packed else None  # one host sync for every level
        x = self._embed(batch)
        rope = self._rope(batch, x)
        residual = None
        # A prefill folds the residual in after each DeepStack layer whether or not it has image rows: a prefill
        # CUDA graph always carries the (aligned, maybe all-False) image rows and so always folds, and a text-only
        # prompt must round the same run eagerly, so its tokens do not depend on which path ran it.
        folds = 0 if batch.is_decode else max(len(deepstack), self.config.num_deepstack_layers)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, self.attn)
            if i < folds:
                # The layer's output is x + residual; fold it into one tensor so the features add to the sum,
                # then let the next layer start as the first one does (residual None).
                x, residual = decode_gemv.merge_parts(x, residual.dtype) + residual, None
                if i < len(deepstack):
                    x = add_deepstack(x, batch.mm_mask, deepstack[i], rows)
        return self._logits(batch, x, residual, out)

    def _split_columns(self, batch: ForwardBatch) -> ForwardBatch:
        """``mm_embeds`` ``[N, hidden * (1 + L)]`` as the encoder sends them -> ``mm_embeds`` ``[N, hidden]`` and
        ``deepstack_embeds`` ``[L, N, hidden]`` (views, no copy of the embedding columns)."""
        mm, hidden = batch.mm_embeds, self.config.hidden_size
        if mm is None or batch.deepstack_embeds is not None or mm.shape[-1] == hidden:
            return batch
        if mm.shape[-1] % hidden:
            raise ValueError(f"mm_embeds of width {mm.shape[-1]} is not a multiple of hidden size {hidden}")
        levels = mm[:, hidden:].unflatten(-1, (-1, hidden)).transpose(0, 1)
        return dataclasses.replace(batch, mm_embeds=mm[:, :hidden], deepstack_embeds=levels)

    @staticmethod
    def _deepstack(batch: ForwardBatch) -> torch.Tensor | tuple[()]:
        """The batch's DeepStack levels ``[L, rows, hidden]``, or ``()`` when it has no image rows."""
        mm = batch.mm_embeds
        if batch.mm_mask is None or mm is None or mm.shape[0] == 0:
            return ()
        ds = batch.deepstack_embeds
        if ds is None:
            raise ValueError("a Qwen3-VL batch with mm_embeds needs deepstack_embeds (the vision tower's DeepStack "
                             "features of the same rows)")
        if ds.dim() != 3 or ds.shape[1] != mm.shape[0]:
            raise ValueError(f"deepstack_embeds {tuple(ds.shape)} must be [levels, {mm.shape[0]}, hidden] like "
                             f"mm_embeds {tuple(mm.shape)}")
        return ds
