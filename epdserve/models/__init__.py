"""epdserve's language models and what they are built from (config, weights, M-RoPE, TP layers, test checkpoints).

:func:`language_model_class` is the one place that maps a checkpoint's ``model_type`` to the LM class.
"""

from __future__ import annotations

from epdserve.models.config import ModelConfig


def language_model_class(cfg: ModelConfig) -> type:
    """The LM class serving ``cfg.model_type``: :class:`~epdserve.models.qwen2_vl_lm.Qwen2VLLanguageModel` for
    ``qwen2_vl`` and ``qwen2_5_vl``, :class:`~epdserve.models.qwen3_vl_lm.Qwen3VLLanguageModel` for ``qwen3_vl``,
    :class:`~epdserve.models.qwen3_vl_moe_lm.Qwen3VLMoeLanguageModel` for ``qwen3_vl_moe``,
    :class:`~epdserve.models.qwen3_5_lm.Qwen3_5LanguageModel` for ``qwen3_5`` (hybrid: also takes a state pool),
    :class:`~epdserve.models.qwen3_5_moe_lm.Qwen3_5MoeLanguageModel` for ``qwen3_5_moe`` (hybrid too).
    Every class takes ``(cfg, attn=None, tp=None)`` and has ``materialize``, ``use_fused_ops``, ``load_weights``
    and ``forward(batch, out=None)``.

    Raises:
        ValueError: a model type no LM class serves.
    """
    if cfg.model_type in ("qwen2_vl", "qwen2_5_vl"):
        from epdserve.models.qwen2_vl_lm import Qwen2VLLanguageModel

        return Qwen2VLLanguageModel
    if cfg.model_type == "qwen3_vl":
        from epdserve.models.qwen3_vl_lm import Qwen3VLLanguageModel

        return Qwen3VLLanguageModel
    if cfg.model_type == "qwen3_vl_moe":
        from epdserve.models.qwen3_vl_moe_lm import Qwen3VLMoeLanguageModel

        return Qwen3VLMoeLanguageModel
    if cfg.model_type == "qwen3_5":
        from epdserve.models.qwen3_5_lm import Qwen3_5LanguageModel

        return Qwen3_5LanguageModel
    if cfg.model_type == "qwen3_5_moe":
        from epdserve.models.qwen3_5_moe_lm import Qwen3_5MoeLanguageModel

        return Qwen3_5MoeLanguageModel
    raise ValueError(f"no language model for model_type {cfg.model_type!r}")
