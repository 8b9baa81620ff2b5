"""epdserve's own Qwen3.5 language model: a hybrid of Gated DeltaNet (linear attention) and gated full-attention
layers, over the paged KV cache (attention layers only) and a :class:`~epdserve.kvcache.state_pool.StatePool`.

Reference: transformers 5 ``models/qwen3_5/modeling_qwen3_5.py`` (``Qwen3_5TextModel``, ``Qwen3_5DecoderLayer``,
``Qwen3_5Attention``, ``Qwen3_5GatedDeltaNet``, ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
``Qwen3_5TextRotaryEmbedding``); the gated delta rule is Yang et al., arXiv:2412.06464. Two implementations of the
DeltaNet layers:

- the torch path (CPU, the reference): the math copied from those classes, the kernels transformers' own torch
  references (``torch_chunk_gated_delta_rule`` for extends, ``torch_recurrent_gated_delta_rule`` for one-token
  steps, ``causal_conv1d_fn`` / ``causal_conv1d_update``), so CPU outputs equal transformers'. Extends loop over
  their requests; decode gathers the slots' states and scatters them back.
- the CUDA path (:mod:`epdserve.models.deltanet_cuda`, ``pip install -e '.[hybrid-gpu]'``): flash-linear-attention's
  kernels over the state pool in place through the slots, every request of an extend in one varlen call, decode
  inside the CUDA graph. With the flashinfer attention backend, the norms (Gemma's, fused with the residual adds)
  and SiLU-and-mul are flashinfer's too (:meth:`Qwen3_5LanguageModel.use_fused_ops`).

What differs from the Qwen2/Qwen3 decoders of :mod:`epdserve.models.qwen2_vl_lm`:

- Norms are zero-centred: ``x_hat * (1 + w)`` in float32, cast after (``Qwen3_5RMSNorm``), for the block norms,
  the final norm and q/k norms. The DeltaNet output norm is ``Qwen3_5RMSNormGated``: ``w * x_hat`` then
  ``* silu(z)``.
- Attention layers: ``q_proj`` yields per head ``[query | gate]`` (``2 * head_dim``); the output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``. RoPE is interleaved M-RoPE over the first ``rotary_dim`` (a quarter) of
  each head only. Only these layers have KV: decoder layer ``attention_layers[i]`` uses KV-pool layer ``i``.
- DeltaNet layers: ``in_proj_qkv`` -> causal depthwise conv1d + SiLU over a window of ``kernel`` tokens
  (state: the last ``kernel`` inputs) -> L2-normed q, k; ``beta = sigmoid(in_proj_b x)``, decay
  ``g = -exp(A_log) * softplus(in_proj_a x + dt_bias)``; the gated delta rule with the slot's recurrent state.

TP (Megatron-style, as Qwen2's layers): attention heads as in :func:`~epdserve.models.parallel.head_shard`; each
DeltaNet layer's key and value heads split evenly over the ranks (rank ``r`` keeps key heads ``[r*hk/n, ...)``
and value heads ``[r*hv/n, ...)``, which are exactly the value heads those key heads serve), so ``in_proj_qkv``
and the conv channels keep this rank's q, k and v heads part by part, ``in_proj_z/a/b``, ``A_log`` and
``dt_bias`` its value heads, and ``out_proj`` is row-parallel; the state pool of a rank holds its heads only
(:func:`~epdserve.models.qwen3_5_deltanet.deltanet_local_shapes`). Images: ``mm_embeds`` rows are spliced in as
for Qwen2 (Qwen3.5 has no DeepStack). Decode CUDA graphs take the slots as a device tensor (padding rows on the
scratch slot); there are no prefill graphs.

A request's first extend (``kv_len == q_len``: no prefix before it) starts from the zero state whatever its slot
holds, as a fresh transformers cache does, so a slot need not be zeroed on every TP rank at allocation.
"""

from __future__ import annotations

import torch
from torch import nn

from epdserve.engine.distributed import TPGroup
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.models.config import ModelConfig
from epdserve.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                      VocabParallelEmbedding, head_shard)
from epdserve.models.qwen2_vl_lm import (FUSED_PARTS, MLP, Qwen2VLLanguageModel, _flashinfer, _rotate,
                                         mrope_cos_sin)
from epdserve.models.qwen3_5_deltanet import DeltaNetBatch, GatedDeltaNet, _deltanet_kernels_available


class ZeroCenteredRMSNorm(nn.Module):
    """``Qwen3_5RMSNorm``: ``(x_hat * (1 + w)).to(x.dtype)`` with ``x_hat`` the float32 RMS-normalised ``x``
    (weights stored centred on 0); optionally fused with the residual add before it, as
    :class:`~epdserve.models.qwen2_vl_lm.RMSNorm`. Fused (``fused``, CUDA): flashinfer's ``gemma_rmsnorm`` /
    ``gemma_fused_add_rmsnorm``, Gemma's norm being this one (float32 inside, ``* (1 + w)``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x`` ``[..., dim]`` -> ``norm(x)``, same shape and dtype; with ``residual`` (``[T, dim]``, ``x`` too):
        ``(norm(x + residual), x + residual)``. Fused, ``x`` and ``residual`` are overwritten in place."""
        if self.fused:
            if residual is None:
                return _flashinfer().norm.gemma_rmsnorm(x.reshape(-1, x.shape[-1]), self.weight,
                                                        self.eps).view(x.shape)
            _flashinfer().norm.gemma_fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual = x + residual
            return self.forward(residual), residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """``Qwen3_5Attention`` over the paged KV: q (with its gate), k, v in one projection; q/k norms; partial
    interleaved M-RoPE; output gated by ``sigmoid(gate)``. ``kv_layer``: this layer's KV-pool layer."""

    def __init__(self, cfg: ModelConfig, kv_layer: int, tp: TPGroup):
        super().__init__()
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp)
        self.kv_layer, self.hq, self.hkv, self.d = kv_layer, heads.num_heads, heads.num_kv_heads, cfg.head_dim
        self.rot, d = cfg.rotary_dim, cfg.head_dim
        q = (2 * cfg.num_heads * d, 2 * heads.q_start * d, 2 * self.hq * d)  # per head [query | gate]
        kv = (cfg.num_kv_heads * d, heads.kv_start * d, self.hkv * d)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp)
        self.q_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rotary_dim`` features of each head (``apply_rotary_pos_emb``), pass the rest."""
        return torch.cat([_rotate(x[..., :self.rot], cos, sin), x[..., self.rot:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; ``cos``/``sin`` ``[T, 1, rotary_dim]``."""
        qg, k, v = self.qkv_proj(x).split([2 * self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, gate = qg.view(-1, self.hq, 2 * self.d).chunk(2, dim=-1)  # per head: [query | gate]
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(k.view(-1, self.hkv, self.d)), cos, sin)
        out = attn.forward(self.kv_layer, q, k, v.view(-1, self.hkv, self.d)).reshape(-1, self.hq * self.d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(-1, self.hq * self.d)))


class HybridDecoderLayer(nn.Module):
    """``Qwen3_5DecoderLayer``: ``h = x + mixer(norm(x))``, ``out = h + mlp(norm(h))``; the mixer is
    :class:`GatedDeltaNet` (``linear_attn``) or :class:`GatedAttention` (``self_attn``); ``mlp`` (default the dense
    :class:`~epdserve.models.qwen2_vl_lm.MLP`) any ``[T, hidden] -> [T, hidden]`` module. The block's output is
    kept as ``(x, residual)`` as in :class:`~epdserve.models.qwen2_vl_lm.DecoderLayer`, so the next norm can fuse
    the add."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, mlp: nn.Module | None = None):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer_id), tp)
        else:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer_id), tp)
        self.mlp = MLP(cfg, tp) if mlp is None else mlp
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, attn, batch, dn: DeltaNetBatch, pool):
        """``(x, residual)`` ``[T, hidden]`` each -> the same after this block (``residual`` None: first block)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.is_linear:
            x = self.linear_attn(x, batch, dn, pool)
        else:
            x = self.self_attn(x, cos, sin, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5LanguageModel(nn.Module):
    """The Qwen3.5 text decoder: the interface of :class:`~epdserve.models.qwen2_vl_lm.Qwen2VLLanguageModel`
    (constructor ``(cfg, attn=None, tp=None)``, :meth:`materialize`, :meth:`use_fused_ops`, :meth:`load_weights`,
    :meth:`forward`), plus ``states`` (a :class:`~epdserve.kvcache.state_pool.StatePool` with
    ``len(cfg.linear_layers)`` layers, set by the runner like ``attn``; plain attributes, not submodules).

    ``tp`` (default: one rank): this process's TP group (see the module docstring for the split).

    Raises:
        ValueError: a config without ``layer_types``, or heads / DeltaNet heads / the intermediate size that do
            not split over ``tp.size`` ranks.
    """

    # Checkpoint projection names -> (fused parameter, part): Qwen2's q/k/v and gate/up, and the DeltaNet inputs.
    fused_parts = {**FUSED_PARTS, "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1),
                   "in_proj_b": ("in_proj", 2), "in_proj_a": ("in_proj", 3)}

    def __init__(self, cfg: ModelConfig, attn=None, tp: TPGroup | None = None):
        super().__init__()
        if not cfg.layer_types:
            raise ValueError(f"{type(self).__name__} needs a config with layer_types (model_type qwen3_5)")
        tp = tp or TPGroup.single()
        self.config, self.attn, self.states, self.fused_ops = cfg, attn, None, False
        self.deltanet_kernels = False  # see use_fused_ops
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, tp, self._mlp(cfg, i, tp))
                                    for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", self._inv_freq(cfg), persistent=False)

    @staticmethod
    def _mlp(cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        """Decoder layer ``layer_id``'s MLP: the dense one (a subclass may give another, e.g. a sparse block)."""
        return MLP(cfg, tp)

    @staticmethod
    def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
        """float32 ``[rotary_dim / 2]`` (``Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters``)."""
        dim = cfg.rotary_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))

    # Same code as Qwen2's: tied re-binding and the RoPE table (materialize); fused parts (``fused_parts``), shape
    # checks and the completeness check (load_weights, names of :func:`~epdserve.models.weights.iter_lm_weights`).
    materialize = Qwen2VLLanguageModel.materialize
    load_weights = Qwen2VLLanguageModel.load_weights

    def use_fused_ops(self, enabled: bool) -> Qwen3_5LanguageModel:
        """Switch norms and SiLU-and-mul to flashinfer's kernels (the Gemma norms, fused with the residual adds),
        as the runner does with the flashinfer attention backend. Independently, the DeltaNet layers of a model on
        CUDA run flash-linear-attention's kernels over the state slots (:mod:`epdserve.models.deltanet_cuda`)
        whatever the attention backend, when ``fla-core`` imports (else transformers' torch code, logged once).
        Call after :meth:`load_weights` (the kernels take derived copies of some weights). Returns self.

        Raises:
            ImportError: enabled and flashinfer is not installed.
        """
        if enabled:
            _flashinfer()
        self.fused_ops = enabled
        # Whether the DeltaNet layers run the CUDA kernels; set here, read by every forward.
        self.deltanet_kernels = kernels = self.embed_tokens.weight.is_cuda and _deltanet_kernels_available()
        for m in self.modules():
            if isinstance(m, (ZeroCenteredRMSNorm, MLP)):
                m.fused = enabled
            elif isinstance(m, GatedDeltaNet):
                m.use_kernels(kernels)
        return self

    def _deltanet_batch(self, batch: ForwardBatch, device: torch.device) -> DeltaNetBatch:
        """The slots (a CUDA graph passes its static device buffer) and, for an extend on the kernels, the token
        offsets; zeroes the slots of requests starting fresh (``kv_len == q_len``: no prefix before them). A prefill
        CUDA graph's extend (slots and ``last_rows`` in device buffers, padding rows after the real ones) gets its
        last real row instead, its slot zeroed by the graph runner before the replay when fresh."""
        slots = batch.state_slots
        if isinstance(slots, torch.Tensor) and not batch.is_decode:
            return DeltaNetBatch(slots, last_row=batch.last_rows)
        if not isinstance(slots, torch.Tensor):
            slots = torch.tensor(slots, dtype=torch.int64, device=device)
        if batch.is_decode or not self.deltanet_kernels:
            return DeltaNetBatch(slots)
        from epdserve.models import deltanet_cuda

        fresh = [s for s, q, kv in zip(batch.state_slots, batch.q_lens, batch.kv_lens) if kv == q]
        if fresh:
            deltanet_cuda.zero_fresh_slots(self.states.conv_buffer, self.states.recurrent_buffer,
                                           torch.tensor(fresh, dtype=torch.int64, device=device))
        cu = torch.tensor([0, *batch.q_lens], dtype=torch.int64).cumsum(0)
        cuts = None
        if batch.state_snapshots:
            cuts = deltanet_cuda.SnapshotCuts.build(batch.q_lens, batch.state_slots, batch.state_snapshots,
                                                    self.config.linear_conv_kernel_dim, device)
        return DeltaNetBatch(slots, cu.to(device, non_blocking=True), cu, cuts=cuts)

    def forward(self, batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``batch`` and return float32 logits ``[B, vocab]`` at each request's last new token (written into
        ``out`` when given), as :meth:`Qwen2VLLanguageModel.forward` does. The attention backend must be prepared
        for ``batch``; the DeltaNet layers read and write the states of ``batch.state_slots``.

        Raises:
            RuntimeError: no attention backend or state pool set.
            ValueError: ``batch.state_slots`` missing or not one per request.
        """
        if self.attn is None or self.states is None:
            raise RuntimeError(f"{type(self).__name__}.attn and .states must be set")
        if batch.state_slots is None or len(batch.state_slots) != batch.batch_size:
            raise ValueError(f"a Qwen3.5 batch needs one state slot per request, got {batch.state_slots}")
        x = Qwen2VLLanguageModel._embed(self, batch)
        dn = self._deltanet_batch(batch, x.device)  # before any layer: it zeroes the fresh requests' slots
        cos, sin = mrope_cos_sin(batch.positions, self.inv_freq, self.config.mrope_section, x.dtype, True)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, self.attn, batch, dn, self.states)
        return Qwen2VLLanguageModel._logits(self, batch, x, residual, out)
