"""epdserve's own Qwen2 decoder LM with M-RoPE: the text half of Qwen2-VL / Qwen2.5-VL.

Architecture: Qwen2 (RMSNorm pre-norm blocks, GQA attention with q/k/v bias, SiLU-gated MLP) as in transformers'
``Qwen2_5_VLTextModel``; M-RoPE from the Qwen2-VL paper (arXiv:2409.12191) and transformers'
``Qwen2_5_VLRotaryEmbedding`` + ``apply_multimodal_rotary_pos_emb`` (rotate-half style). Attention goes through an
:class:`~epdserve.attention.base.AttentionBackend`, which owns the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from epdserve.attention.base import AttentionBackend
from epdserve.forward_batch import ForwardBatch
from epdserve.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers' ``Qwen2RMSNorm``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, dim]`` -> ``[T, dim]`` in ``x``'s dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, head_dim]`` for positions ``[3, T]``: frequency band ``i`` of the ``mrope_section`` split
    takes its angle from axis ``i % 3`` (t, h, w), then the half is duplicated for rotate-half."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, T, D/2]
    freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(freqs.split(list(section), dim=-1))], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention; q/k/v are one fused projection (with bias), o_proj has none."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id, self.hq, self.hkv, self.d = layer_id, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=True)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        q, k, v = self.qkv_proj(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = _rotate(q.view(-1, self.hq, self.d), cos, sin)
        k = _rotate(k.view(-1, self.hkv, self.d), cos, sin)
        out = attn.forward(self.layer_id, q, k, v.view(-1, self.hkv, self.d))
        return self.o_proj(out.reshape(-1, self.hq * self.d))


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoint projection names -> (fused parameter, index of the part within it).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Qwen2VLLanguageModel(nn.Module):
    """The Qwen2-VL / Qwen2.5-VL text decoder over a paged KV cache.

    ``attn`` (an :class:`AttentionBackend`) must be set before :meth:`forward`; it is a plain attribute, not a
    submodule, so moving the model between devices never touches the KV pool.
    """

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend | None = None):
        super().__init__()
        self.config = cfg
        self.attn = attn
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", self._inv_freq(cfg), persistent=False)

    @staticmethod
    def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))

    def materialize(self, device: torch.device, dtype: torch.dtype) -> Qwen2VLLanguageModel:
        """Give a model built on the meta device real (uninitialised) ``dtype`` storage on ``device``, re-tie
        lm_head to embed_tokens (``to_empty`` unties them) and rebuild the float32 RoPE table. Returns self."""
        self.to(dtype).to_empty(device=device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = self._inv_freq(self.config).to(device)
        return self

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(lm_name, tensor)`` pairs (see :func:`epdserve.models.weights.iter_lm_weights`) into the
        parameters, filling the fused ``qkv_proj``/``gate_up_proj`` from their parts.

        Raises:
            ValueError: an unknown name, a shape mismatch, or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        parts_done: dict[str, int] = {}
        hq, hkv, d, inter = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim, \
            self.config.intermediate_size
        sizes = {"qkv_proj": [hq * d, hkv * d, hkv * d], "gate_up_proj": [inter, inter]}
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # shares embed_tokens' parameter
            target, part = name, None
            for piece, (fused_name, idx) in _FUSED.items():
                if f".{piece}." in name:
                    target, part = name.replace(f".{piece}.", f".{fused_name}."), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the LM")
            dst = param.data
            if part is not None:
                dst = dst.split(sizes["qkv_proj" if "qkv_proj" in target else "gate_up_proj"], dim=0)[part]
                parts_done[target] = parts_done.get(target, 0) + 1
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target)
        missing = [n for n in params if n not in loaded]
        partial = [n for n, c in parts_done.items() if c != (3 if "qkv_proj" in n else 2)]
        if missing or partial:
            raise ValueError(f"checkpoint lacks LM tensors: {sorted(missing + partial)[:8]}")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` (tensors on the model's device) and return float32 logits ``[B, vocab]`` at each
        request's last new token; ``lm_head`` runs on those B rows only.

        Rows where ``batch.mm_mask`` is True take ``batch.mm_embeds`` (cast to the model dtype) instead of the
        token embedding.

        Raises:
            RuntimeError: no attention backend set, or ``mm_embeds`` row count != ``mm_mask.sum()``.
        """
        if self.attn is None:
            raise RuntimeError("Qwen2VLLanguageModel.attn is not set")
        self.attn.prepare(batch)
        x = self.embed_tokens(batch.input_ids)
        if batch.mm_mask is not None and batch.mm_embeds is not None:
            x[batch.mm_mask] = batch.mm_embeds.to(x.dtype)
        cos, sin = mrope_cos_sin(batch.positions, self.inv_freq, self.config.mrope_section, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, self.attn)
        last = torch.tensor(batch.q_lens, device=x.device).cumsum(0) - 1
        return self.lm_head(self.norm(x[last])).float()
