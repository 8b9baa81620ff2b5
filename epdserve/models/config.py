"""The language-model facts epdserve needs from a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoint's
``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

# What transformers' config classes assume when a key is absent. Qwen3-VL (``Qwen3VLTextConfig``) has an explicit
# ``head_dim`` defaulting to 128 and ``mrope_section`` [24, 20, 20] (``Qwen3VLTextRotaryEmbedding``); Qwen2-VL and
# Qwen2.5-VL derive head_dim from hidden / heads and default to [16, 24, 24].
# Qwen3.5 (``Qwen3_5TextConfig``, ``Qwen3_5TextRotaryEmbedding``): head_dim 256, [11, 11, 10] over the rotary quarter
# of head_dim (``partial_rotary_factor`` 0.25), no DeepStack.
# Qwen3-VL-MoE (``Qwen3VLMoeTextConfig``) shares Qwen3-VL's attention, RoPE and vision defaults, Qwen3.5-MoE
# (``Qwen3_5MoeTextConfig``) Qwen3.5's.
_DEFAULT_MROPE_SECTION = {"qwen3_vl": (24, 20, 20), "qwen3_vl_moe": (24, 20, 20), "qwen3_5": (11, 11, 10),
                          "qwen3_5_moe": (11, 11, 10)}
_DEFAULT_HEAD_DIM = {"qwen3_vl": 128, "qwen3_vl_moe": 128, "qwen3_5": 256, "qwen3_5_moe": 256}
_DEFAULT_ROPE_THETA = {"qwen3_vl": 500000.0, "qwen3_vl_moe": 500000.0, "qwen3_5": 10000000.0,
                       "qwen3_5_moe": 10000000.0}
# Qwen3VLVisionConfig.deepstack_visual_indexes (and Qwen3VLMoeVisionConfig's)
_DEFAULT_DEEPSTACK = {"qwen3_vl": (8, 16, 24), "qwen3_vl_moe": (8, 16, 24)}
_DEFAULT_PARTIAL_ROTARY = {"qwen3_5": 0.25, "qwen3_5_moe": 0.25}
_HYBRID = ("qwen3_5", "qwen3_5_moe")
# Expert defaults of Qwen3VLMoeTextConfig and Qwen3_5MoeTextConfig: (experts, top-k, expert and shared-expert
# intermediate sizes). Qwen3.5-MoE has no dense layers (no intermediate_size, decoder_sparse_step, mlp_only_layers).
_MOE_DEFAULTS = {"qwen3_vl_moe": (60, 4, 1408, 0), "qwen3_5_moe": (256, 8, 512, 512)}
# transformers' Qwen3VLTextRotaryEmbedding (and Qwen3_5TextRotaryEmbedding) always interleaves (the checkpoints'
# ``mrope_interleaved: true`` is informative only); Qwen2/2.5-VL never do.
_INTERLEAVED_MROPE = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Qwen3_5TextConfig's defaults for the Gated DeltaNet (linear-attention) layers.
_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}

# Defaults of the released checkpoints (and of transformers' config classes) for keys old configs may omit.
_DEFAULT_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
                      "vision_start_token_id": 151652, "vision_end_token_id": 151653}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass(frozen=True)
class ModelConfig:
    """Text-decoder shape, M-RoPE and special tokens of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoint.

    ``head_dim``: Qwen2-VL / Qwen2.5-VL: ``hidden_size // num_heads``, as transformers' ``Qwen2_5_VLAttention``
    computes it (it ignores a ``head_dim`` key); Qwen3-VL: the config's ``head_dim`` (default 128), which may differ
    from hidden / heads (Qwen3-VL-4B: 2560 / 32 heads, head_dim 128). ``mrope_section`` splits the ``head_dim / 2``
    rotary frequencies over (t, h, w): in chunks (Qwen2/2.5-VL) or, with ``mrope_interleaved``, interleaved
    t,h,w,t,h,w,... (Qwen3-VL, ``rope_scaling.mrope_interleaved``). ``deepstack_visual_indexes`` (Qwen3-VL,
    ``vision_config``): the vision blocks whose features are added to the hidden states of the image tokens after
    decoder layers ``0 .. len - 1`` (DeepStack); empty for Qwen2/2.5-VL. ``eos_token_ids`` is the sorted union of
    ``config.json`` and ``generation_config.json`` eos ids.

    Qwen3.5 (hybrid): ``rotary_dim`` is ``int(head_dim * partial_rotary_factor)`` (0.25: only the first quarter of
    each head is rotated, transformers' ``apply_rotary_pos_emb`` with a short cos), and ``mrope_section`` sums to
    ``rotary_dim / 2``; other models rotate all of ``head_dim`` (``rotary_dim == head_dim``). ``layer_types``: per
    decoder layer ``"full_attention"`` (gated attention over the paged KV) or ``"linear_attention"`` (Gated
    DeltaNet over the state pool); from the config, else every ``full_attention_interval``-th (default 4) layer is
    full attention, as ``Qwen3_5TextConfig.__post_init__`` derives it; empty for non-hybrid models (all layers
    attention). ``linear_*``: the DeltaNet's key/value head counts and sizes and the causal conv1d kernel width.
    """

    model_path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    eos_token_ids: tuple[int, ...]
    mrope_interleaved: bool = False
    deepstack_visual_indexes: tuple[int, ...] = ()
    rotary_dim: int = 0  # 0: head_dim (set by load)
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Qwen3-VL-MoE and Qwen3.5-MoE (0 experts: a dense model): see epdserve.models.qwen3_vl_moe_lm and
    # epdserve.models.qwen3_5_moe_lm; shared_expert_intermediate_size > 0: each sparse block adds a gated shared
    # expert (Qwen3.5-MoE).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some decoder layers are Gated DeltaNet layers (they need a :class:`StatePool`, no KV)."""
        return "linear_attention" in self.layer_types

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Decoder-layer ids of the layers that keep KV, in order; KV-pool layer ``i`` is
        ``attention_layers[i]``'s."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Decoder-layer ids of the Gated DeltaNet layers, in order; state-pool layer ``i`` is
        ``linear_layers[i]``'s."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        """Layers of the KV pool: the attention layers' count."""
        return len(self.attention_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a DeltaNet layer's causal conv1d (and conv state): q, k and v features,
        ``2 * key_heads * key_dim + value_heads * value_dim`` (``Qwen3_5GatedDeltaNet.conv_dim``)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def num_deepstack_layers(self) -> int:
        """How many decoder layers (the first ones) take DeepStack features: 0 for Qwen2/2.5-VL."""
        return len(self.deepstack_visual_indexes)

    @property
    def embed_width(self) -> int:
        """Columns of one image token's row from the encoder: ``hidden_size`` for Qwen2/2.5-VL; Qwen3-VL appends
        its DeepStack levels, ``hidden_size * (1 + num_deepstack_layers)`` (see :mod:`epdserve.encoder.vision`)."""
        return self.hidden_size * (1 + self.num_deepstack_layers)

    @classmethod
    def load(cls, model_path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` when present) of a local checkpoint.

        Reads both layouts: transformers 5 (text keys in ``text_config``, ``rope_theta``/``mrope_section`` in
        ``text_config.rope_parameters``) and the hub layout of released checkpoints (Qwen2/2.5-VL: text keys at
        top level, ``rope_scaling = {"type": "mrope", "mrope_section": [...]}``, top-level ``rope_theta``;
        Qwen3-VL: text keys in ``text_config`` with ``rope_theta`` and ``rope_scaling = {"mrope_interleaved": true,
        "mrope_section": [24, 20, 20], "rope_type": "default"}`` there). Text keys are looked up in
        ``text_config`` first, then at top level.

        Raises:
            FileNotFoundError: no ``config.json`` in ``model_path``.
            ValueError: unsupported ``model_type``, missing shape keys, or ``mrope_section`` not summing to
                ``head_dim / 2``.
        """
        root = Path(model_path)
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in {str(model_path)!r}")
        cfg = json.loads(cfg_file.read_text())
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} in {cfg_file}; "
                             f"epdserve serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        text = cfg.get("text_config") or {}
        vision = cfg.get("vision_config") or {}

        def get(key: str, default: Any = None) -> Any:
            if text.get(key) is not None:
                return text[key]
            return cfg.get(key, default)

        def need(key: str) -> Any:
            value = get(key)
            if value is None:
                raise ValueError(f"{cfg_file} has no {key!r} (neither in text_config nor at top level)")
            return value

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = hidden // heads
        if model_type in _DEFAULT_HEAD_DIM:
            head_dim = int(get("head_dim") or _DEFAULT_HEAD_DIM[model_type])
        mrope_section, rope_theta, rotary_dim = _rope_fields(model_type, get, head_dim)
        hybrid = _hybrid_fields(model_type, get, int(need("num_hidden_layers")))

        eos = set(_ids(get("eos_token_id")))
        gen_file = root / "generation_config.json"
        if gen_file.is_file():
            eos |= set(_ids(json.loads(gen_file.read_text()).get("eos_token_id")))
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            model_path=str(model_path),
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense MLP, and no intermediate_size key.
            intermediate_size=int(get("intermediate_size", 0) if model_type == "qwen3_5_moe"
                                  else need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            mrope_section=mrope_section,  # type: ignore[arg-type]
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(tie),
            **{k: int(cfg.get(k, text.get(k, d))) for k, d in _DEFAULT_TOKEN_IDS.items()},
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            eos_token_ids=tuple(sorted(eos)),
            mrope_interleaved=model_type in _INTERLEAVED_MROPE,
            deepstack_visual_indexes=tuple(int(i) for i in vision.get(
                "deepstack_visual_indexes", _DEFAULT_DEEPSTACK.get(model_type, ())) or ()),
            rotary_dim=rotary_dim,
            **hybrid,
            **_moe_fields(model_type, get),
        )


def _rope_fields(model_type: str, get, head_dim: int) -> tuple[tuple[int, int, int], float, int]:
    """``(mrope_section, rope_theta, rotary_dim)`` from ``rope_scaling`` / ``rope_parameters`` (``get`` looks a
    text key up) with the model type's defaults; ``rotary_dim = int(head_dim * partial_rotary_factor)``.

    Raises:
        ValueError: ``mrope_section`` not 3 parts summing to ``rotary_dim / 2``.
    """
    rope = dict(get("rope_scaling") or {})
    rope.update(get("rope_parameters") or {})
    section = tuple(int(s) for s in rope.get("mrope_section", _DEFAULT_MROPE_SECTION.get(model_type, (16, 24, 24))))
    theta = float(rope.get("rope_theta", get("rope_theta", _DEFAULT_ROPE_THETA.get(model_type, 1e6))))
    partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor",
                                                           _DEFAULT_PARTIAL_ROTARY.get(model_type, 1.0))))
    rotary_dim = int(head_dim * partial)
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must have 3 parts summing to rotary_dim/2 = "
                         f"{rotary_dim // 2}")
    return section, theta, rotary_dim  # type: ignore[return-value]


def _moe_fields(model_type: str, get) -> dict[str, Any]:
    """The expert sizes of a Qwen3-VL-MoE or Qwen3.5-MoE text config with their config classes' defaults
    (``_MOE_DEFAULTS``; Qwen3-VL-MoE: sparse step 1, no MLP-only layers; Qwen3.5-MoE: every layer sparse, with a
    shared expert); ``{}`` for other models. The expert count is ``num_experts`` in the released configs and
    ``num_local_experts`` in what transformers 5 writes of Qwen3-VL-MoE (its ``attribute_map``)."""
    if model_type not in _MOE_DEFAULTS:
        return {}
    experts, top_k, inter, shared = _MOE_DEFAULTS[model_type]
    out = {"num_experts": int(get("num_experts", get("num_local_experts", experts))),
           "num_experts_per_tok": int(get("num_experts_per_tok", top_k)),
           "moe_intermediate_size": int(get("moe_intermediate_size", inter))}
    if model_type == "qwen3_5_moe":
        return {**out, "shared_expert_intermediate_size": int(get("shared_expert_intermediate_size", shared))}
    return {**out, "decoder_sparse_step": int(get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in get("mlp_only_layers", ()) or ())}


def _hybrid_fields(model_type: str, get, num_layers: int) -> dict[str, Any]:
    """``layer_types`` and the ``linear_*`` sizes of a Qwen3.5 text config (``get`` looks a text key up), with
    ``Qwen3_5TextConfig``'s defaults; ``{}`` for other models.

    Raises:
        ValueError: ``layer_types`` of the wrong length or with an unknown type.
    """
    if model_type not in _HYBRID:
        return {}
    types = get("layer_types")
    if types is None:
        interval = int(get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} must name full_attention or linear_attention for each of "
                         f"{num_layers} layers")
    out: dict[str, Any] = {"layer_types": tuple(types)}
    for key, default in _LINEAR_DEFAULTS.items():
        out[key] = int(get(key, default))
    return out
