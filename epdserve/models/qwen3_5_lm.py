"""epdserve's own Qwen3.5 language model: a hybrid of Gated DeltaNet (linear attention) and gated full-attention
layers, over the paged KV cache (attention layers only) and a :class:`~epdserve.kvcache.state_pool.StatePool`.

Reference: transformers 5 ``models/qwen3_5/modeling_qwen3_5.py`` (``Qwen3_5TextModel``, ``Qwen3_5DecoderLayer``,
``Qwen3_5Attention``, ``Qwen3_5GatedDeltaNet``, ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
``Qwen3_5TextRotaryEmbedding``); the gated delta rule is Yang et al., arXiv:2412.06464. The math is copied from
those classes, and the DeltaNet kernels are transformers' own torch references (``torch_chunk_gated_delta_rule``
for extends, ``torch_recurrent_gated_delta_rule`` for one-token steps, ``causal_conv1d_fn`` /
``causal_conv1d_update``), so CPU outputs equal transformers'. On CUDA these are where flash-linear-attention's
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (varlen, ``cu_seqlens``, states indexed by slot)
and the ``causal_conv1d`` package's kernels plug in; today extends loop over requests.

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

TP: one rank only (raises for more). Images: ``mm_embeds`` rows are spliced in as for Qwen2 (untested: Qwen3.5's
vision side comes later). No flashinfer fused ops and no CUDA graphs yet (the runner builds none for this model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.engine.distributed import TPGroup
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.state_pool import StatePool
from epdserve.models.config import ModelConfig
from epdserve.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                      VocabParallelEmbedding)
from epdserve.models.qwen2_vl_lm import MLP, Qwen2VLLanguageModel, _rotate, mrope_cos_sin


def _ref():
    """transformers' Qwen3.5 module, whose torch reference kernels the DeltaNet layers call (imported on first
    use, like flashinfer elsewhere)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


class ZeroCenteredRMSNorm(nn.Module):
    """``Qwen3_5RMSNorm``: ``(x_hat * (1 + w)).to(x.dtype)`` with ``x_hat`` the float32 RMS-normalised ``x``
    (weights stored centred on 0). ``[..., dim]`` -> same shape and dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """``Qwen3_5RMSNormGated``: ``w * norm(x).to(x.dtype) * silu(z.float())``, cast to ``x.dtype``; ``x``, ``z``
    ``[N, dim]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedAttention(nn.Module):
    """``Qwen3_5Attention`` over the paged KV: q (with its gate), k, v in one projection; q/k norms; partial
    interleaved M-RoPE; output gated by ``sigmoid(gate)``. ``kv_layer``: this layer's KV-pool layer."""

    def __init__(self, cfg: ModelConfig, kv_layer: int):
        super().__init__()
        self.kv_layer, self.hq, self.hkv, self.d = kv_layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rot = cfg.rotary_dim
        q, kv = 2 * self.hq * self.d, self.hkv * self.d
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [(q, 0, q), (kv, 0, kv), (kv, 0, kv)], bias=False)
        self.o_proj = RowParallelLinear(self.hq * self.d, cfg.hidden_size, TPGroup.single())
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


class GatedDeltaNet(nn.Module):
    """``Qwen3_5GatedDeltaNet`` over a :class:`StatePool` (parameter names as in the checkpoint). ``state_layer``:
    this layer's index among the pool's layers."""

    def __init__(self, cfg: ModelConfig, state_layer: int):
        super().__init__()
        self.state_layer = state_layer
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        conv_dim = cfg.linear_conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, slots: torch.Tensor, pool: StatePool) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; reads and writes the states of ``slots`` (int64 ``[B]``)."""
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if batch.is_decode:
            core = self._step(mixed, g, beta, slots, pool)
        else:
            core, start = [], 0
            for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
                end = start + q_len
                core.append(self._extend(mixed[start:end], g[start:end], beta[start:end], slots[i:i + 1], pool,
                                         continued=kv_len > q_len))
                start = end
            core = torch.cat(core)
        z = self.in_proj_z(x).reshape(-1, self.dv)
        return self.out_proj(self.norm(core.reshape(-1, self.dv), z).reshape(x.shape[0], -1))

    def _qkv(self, conv_out: torch.Tensor, n: int, t: int):
        """Conv output ``[n, t, conv_dim]`` -> q, k ``[n, t, hk, dk]`` and v ``[n, t, hv, dv]``."""
        q, k, v = conv_out.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        return q.reshape(n, t, -1, self.dk), k.reshape(n, t, -1, self.dk), v.reshape(n, t, -1, self.dv)

    def _step(self, mixed, g, beta, slots, pool) -> torch.Tensor:
        """One token for each of B requests: ``causal_conv1d_update`` and ``torch_recurrent_gated_delta_rule``
        (the path transformers takes for a cached one-token step), batched over the requests' slots."""
        ref, layer = _ref(), self.state_layer
        conv_state = pool.conv[layer][slots]  # a gathered copy, updated in place, scattered back
        out = ref.causal_conv1d_update(mixed[:, :, None], conv_state, self.conv1d.weight.squeeze(1), None, "silu")
        pool.conv[layer][slots] = conv_state
        q, k, v = self._qkv(out.transpose(1, 2), mixed.shape[0], 1)
        core, state = ref.torch_recurrent_gated_delta_rule(
            q, k, v, g=g[:, None], beta=beta[:, None], initial_state=pool.recurrent[layer][slots],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        pool.recurrent[layer][slots] = state.to(pool.recurrent_dtype)
        return core

    def _extend(self, mixed, g, beta, slot, pool, continued: bool) -> torch.Tensor:
        """One request's ``q_len`` new tokens after its slot's state: the conv runs over ``[state | new]``
        (``update_conv_state`` then ``causal_conv1d_fn``; a fresh slot's zeros equal the conv's zero padding);
        the delta rule is ``torch_chunk_gated_delta_rule`` from the slot's state, or, for one token continuing a
        state, ``torch_recurrent_gated_delta_rule`` (transformers' choice for ``seq_len == 1`` with a cache)."""
        ref, layer, t = _ref(), self.state_layer, mixed.shape[0]
        full = torch.cat([pool.conv[layer][slot], mixed.T[None].to(pool.dtype)], dim=-1)  # [1, C, K + t]
        pool.conv[layer][slot] = full[..., -self.kernel:]
        out = ref.causal_conv1d_fn(full, self.conv1d.weight.squeeze(1), None, activation="silu")[..., -t:]
        q, k, v = self._qkv(out.transpose(1, 2).to(mixed.dtype), 1, t)
        rule = ref.torch_recurrent_gated_delta_rule if continued and t == 1 else ref.torch_chunk_gated_delta_rule
        core, state = rule(q, k, v, g=g[None], beta=beta[None], initial_state=pool.recurrent[layer][slot],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        pool.recurrent[layer][slot] = state.to(pool.recurrent_dtype)
        return core[0]


class HybridDecoderLayer(nn.Module):
    """``Qwen3_5DecoderLayer``: ``h = x + mixer(norm(x))``, ``out = h + mlp(norm(h))``; the mixer is
    :class:`GatedDeltaNet` (``linear_attn``) or :class:`GatedAttention` (``self_attn``)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer_id))
        else:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer_id))
        self.mlp = MLP(cfg, TPGroup.single())
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn, batch, slots, pool) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, batch, slots, pool)
        else:
            h = self.self_attn(h, cos, sin, attn)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5LanguageModel(nn.Module):
    """The Qwen3.5 text decoder: the interface of :class:`~epdserve.models.qwen2_vl_lm.Qwen2VLLanguageModel`
    (constructor ``(cfg, attn=None, tp=None)``, :meth:`materialize`, :meth:`use_fused_ops`, :meth:`load_weights`,
    :meth:`forward`), plus ``states`` (a :class:`StatePool` with ``len(cfg.linear_layers)`` layers, set by the
    runner like ``attn``; plain attributes, not submodules).

    Raises:
        ValueError: ``tp.size > 1`` (not implemented yet) or a config without ``layer_types``.
    """

    def __init__(self, cfg: ModelConfig, attn=None, tp: TPGroup | None = None):
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("Qwen3.5 runs on one TP rank for now (tensor parallelism is not implemented)")
        if not cfg.layer_types:
            raise ValueError("Qwen3_5LanguageModel needs a config with layer_types (model_type qwen3_5)")
        tp = TPGroup.single()
        self.config, self.attn, self.states, self.fused_ops = cfg, attn, None, False
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", self._inv_freq(cfg), persistent=False)

    @staticmethod
    def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
        """float32 ``[rotary_dim / 2]`` (``Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters``)."""
        dim = cfg.rotary_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    # Same code as Qwen2's: tied re-binding and the RoPE table (materialize); fused q/k/v and gate/up parts, shape
    # checks and the completeness check (load_weights, names of :func:`~epdserve.models.weights.iter_lm_weights`).
    materialize = Qwen2VLLanguageModel.materialize
    load_weights = Qwen2VLLanguageModel.load_weights

    def use_fused_ops(self, enabled: bool) -> Qwen3_5LanguageModel:
        """Recorded only: Qwen3.5 always runs its torch ops (no flashinfer fused path yet). Returns self."""
        self.fused_ops = enabled
        return self

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
        slots = torch.tensor(batch.state_slots, dtype=torch.int64, device=x.device)
        cos, sin = mrope_cos_sin(batch.positions, self.inv_freq, self.config.mrope_section, x.dtype, True)
        for layer in self.layers:
            x = layer(x, cos, sin, self.attn, batch, slots, self.states)
        return Qwen2VLLanguageModel._logits(self, batch, x, None, out)
