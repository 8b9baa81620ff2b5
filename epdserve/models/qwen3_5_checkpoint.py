"""The Qwen3.5 parts of epdserve's random-weight checkpoints: config and tiny model (``make-tiny-model --arch
qwen3.5``).

The architecture is transformers 5's ``Qwen3_5ForConditionalGeneration`` (``configuration_qwen3_5.py``): a hybrid
text model whose ``layer_types`` mix Gated DeltaNet (``linear_attention``) and gated full-attention layers, and a
Qwen3-VL-style vision tower (no DeepStack). transformers maps ``qwen3_5`` to ``Qwen3VLProcessor``
(``processing_auto.py``), so the processor is Qwen3-VL's (:func:`~epdserve.models.qwen3_vl_checkpoint.
write_qwen3_vl_processor`), with Qwen3-VL's chat template (the released Qwen3.5 template, with its thinking
switch, is not copied yet). The tokenizer is the offline one of :mod:`epdserve.models.checkpoint_parts`.
"""

from __future__ import annotations

from pathlib import Path

# tiny: four layers, DeltaNet, DeltaNet, attention, DeltaNet (the attention layer is not the last, so the KV-layer
# map is exercised); head_dim 64 with the released partial_rotary_factor 0.25 (16 rotated features, mrope_section
# summing to 8); DeltaNet with 2 key heads serving 4 value heads (the grouped case of the released models).
QWEN3_5_SIZES = {
    "tiny": dict(text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64,
                           layer_types=["linear_attention", "linear_attention", "full_attention",
                                        "linear_attention"],
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                           linear_value_head_dim=32, linear_conv_kernel_dim=4, mrope_section=[3, 3, 2]),
                 vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4)),
}


def qwen3_5_config(tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """``(Qwen3_5Config, Qwen3_5ForConditionalGeneration)`` for the given sizes, completed with the released
    settings: rope theta 1e7, interleaved M-RoPE over ``partial_rotary_factor`` 0.25 of ``head_dim``, RMS eps 1e-6,
    ``initializer_range`` 0.02; vision patch 16, merge 2, temporal patch 2, ``out_hidden_size`` = text hidden.
    Special token ids come from ``tokenizer``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from epdserve.models.checkpoint_parts import special_token_ids

    special = special_token_ids(tokenizer)
    text = dict(text)
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "mrope_interleaved": True,
            "partial_rotary_factor": 0.25, "mrope_section": text.pop("mrope_section", [11, 11, 10])}
    text_config = dict(rms_norm_eps=1e-6, initializer_range=0.02, rope_parameters=rope,
                       tie_word_embeddings=tie_word_embeddings, bos_token_id=special["bos_token_id"],
                       eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"], **text)
    vision_config = dict(in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                         num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", initializer_range=0.02,
                         out_hidden_size=text["hidden_size"], **vision)
    ids = {k: special[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id")}
    config = Qwen3_5Config(text_config=text_config, vision_config=vision_config,
                           tie_word_embeddings=tie_word_embeddings, **ids)
    return config, Qwen3_5ForConditionalGeneration


def make_tiny_qwen3_5(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 512 * 32 * 32,
                      size: str = "tiny", readable: bool = False) -> Path:
    """Write a small random-weight Qwen3.5 checkpoint (fp32, transformers' own init under
    ``torch.manual_seed(seed)``) to ``out_dir`` and return its path; see :func:`epdserve.models.tiny.make_tiny_model`
    for ``readable`` and ``max_pixels``.

    Raises:
        ValueError: unknown ``size`` (see ``QWEN3_5_SIZES``).
    """
    from epdserve.models.checkpoint_parts import build_tokenizer, save_random_model
    from epdserve.models.qwen3_vl_checkpoint import write_qwen3_vl_processor

    if size not in QWEN3_5_SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(QWEN3_5_SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    dims = QWEN3_5_SIZES[size]
    text = dict(vocab_size=len(tokenizer), max_position_embeddings=4096, **dims["text"])
    config, model_cls = qwen3_5_config(tokenizer, text=text, vision=dims["vision"], tie_word_embeddings=False)
    save_random_model(out, model_cls, config, tokenizer, seed=seed, readable=readable)
    write_qwen3_vl_processor(out, tokenizer, image_pixels=(64 * 64, max_pixels))
    return out
