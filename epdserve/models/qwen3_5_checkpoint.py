"""The Qwen3.5 parts of epdserve's random-weight checkpoints: configs and tiny models (``make-tiny-model --arch
qwen3.5``, and Qwen3.5-MoE's ``--arch qwen3.5-moe``); :mod:`epdserve.models.presets` uses :func:`qwen3_5_config` for
the ``qwen3.5-*`` presets and :func:`qwen3_5_moe_config` for ``qwen3.5-35b-a3b``.

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
# map is exercised; the released models' 3 : 1 ratio); head_dim 64 with the released partial_rotary_factor 0.25 (16
# rotated features, mrope_section summing to 8); 8 query heads per 2 KV heads (the released 4 : 1 grouping of 0.8B,
# 2B, 4B and 9B; 27B has 6 : 1); DeltaNet with 2 key heads serving 4 value heads of equal key and value dims (the
# grouped case of 4B and 9B; 0.8B and 2B have as many value as key heads, 27B three times as many; see
# epdserve.models.presets).
QWEN3_5_SIZES = {
    "tiny": dict(text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64,
                           layer_types=["linear_attention", "linear_attention", "full_attention",
                                        "linear_attention"],
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                           linear_value_head_dim=32, linear_conv_kernel_dim=4, mrope_section=[3, 3, 2]),
                 vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4)),
    # small (GPU tests): the 9B's head shapes (attention head_dim 256; DeltaNet 16 key / 32 value heads of 128, so
    # flash-linear-attention's kernels run at their real tile sizes) on two 3 + 1 layer groups of width 1024.
    "small": dict(text=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=256,
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, mrope_section=[11, 11, 10]),
                  vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4)),
}


# Qwen3.5-MoE (``--arch qwen3.5-moe``) at the released Qwen3.5-35B-A3B's ratios (transformers 5's
# Qwen3_5MoeTextConfig defaults, its docstring's checkpoint; public configs of Qwen3.5/3.6-35B-A3B quote the same:
# 40 layers of 2048, 16 Q / 2 KV heads of 256, 16 K / 32 V DeltaNet heads of 128, 256 experts top-8 of 512 and a
# shared expert of 512, no dense MLP): at width 128, 8 Q per KV head, heads * head_dim twice the width, experts and
# shared expert a quarter of the width; the tiny Qwen3.5's layer layout, DeltaNet and tower. 16 experts top-2, not
# the released 32 per chosen one: the CPU reference runs one matmul pair per hit expert, and 64 made a launch's
# prefill too slow on a loaded 2-core machine.
QWEN3_5_MOE_SIZES = {
    "tiny": dict(text=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1,
                           head_dim=32, layer_types=QWEN3_5_SIZES["tiny"]["text"]["layer_types"],
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                           linear_value_head_dim=32, linear_conv_kernel_dim=4, mrope_section=[2, 1, 1],
                           num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32),
                 vision=QWEN3_5_SIZES["tiny"]["vision"]),
}


def qwen3_5_config(tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """``(Qwen3_5Config, Qwen3_5ForConditionalGeneration)`` for the given sizes, completed with the released
    settings: rope theta 1e7, interleaved M-RoPE over ``partial_rotary_factor`` 0.25 of ``head_dim``, RMS eps 1e-6,
    ``initializer_range`` 0.02; vision patch 16, merge 2, temporal patch 2, ``out_hidden_size`` = text hidden.
    Special token ids come from ``tokenizer``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return _qwen3_5_family(Qwen3_5Config, Qwen3_5ForConditionalGeneration, tokenizer, text, vision,
                           tie_word_embeddings)


def make_tiny_qwen3_5(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 512 * 32 * 32,
                      size: str = "tiny", readable: bool = False) -> Path:
    """Write a small random-weight Qwen3.5 checkpoint (fp32, transformers' own init under
    ``torch.manual_seed(seed)``) to ``out_dir`` and return its path; see :func:`epdserve.models.tiny.make_tiny_model`
    for ``readable`` and ``max_pixels``.

    Raises:
        ValueError: unknown ``size`` (see ``QWEN3_5_SIZES``).
    """
    from epdserve.models.qwen3_vl_checkpoint import write_random_qwen3_family

    return write_random_qwen3_family(out_dir, QWEN3_5_SIZES, qwen3_5_config, seed=seed, max_pixels=max_pixels,
                                     size=size, readable=readable)



def qwen3_5_moe_config(tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """``(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)`` for the given sizes (the expert keys in ``text``),
    completed as :func:`qwen3_5_config` completes Qwen3.5's."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    return _qwen3_5_family(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, tokenizer, text, vision,
                           tie_word_embeddings)


def _qwen3_5_family(config_cls, model_cls, tokenizer, text: dict, vision: dict, tie_word_embeddings: bool):
    """``(config_cls(...), model_cls)`` with the released Qwen3.5 settings (see :func:`qwen3_5_config`)."""
    from epdserve.models.qwen3_vl_checkpoint import qwen3_family_parts

    text = dict(text)
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "mrope_interleaved": True,
            "partial_rotary_factor": 0.25, "mrope_section": text.pop("mrope_section", [11, 11, 10])}
    text_config, vision_config, ids = qwen3_family_parts(tokenizer, text, vision, rope, tie_word_embeddings)
    config = config_cls(text_config=text_config, vision_config=vision_config,
                        tie_word_embeddings=tie_word_embeddings, **ids)
    return config, model_cls


def make_tiny_qwen3_5_moe(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 512 * 32 * 32,
                          size: str = "tiny", readable: bool = False) -> Path:
    """Write a small random-weight Qwen3.5-MoE checkpoint (fp32, transformers' own init under
    ``torch.manual_seed(seed)``) to ``out_dir`` and return its path; the experts are stored fused as released
    (``save_pretrained`` writes one tensor per expert; :func:`~epdserve.models.qwen3_5_moe_lm.fuse_per_expert`
    stacks them). See :func:`epdserve.models.tiny.make_tiny_model` for ``readable`` and ``max_pixels``.

    Raises:
        ValueError: unknown ``size`` (see ``QWEN3_5_MOE_SIZES``).
    """
    from epdserve.models.qwen3_vl_checkpoint import write_random_qwen3_family

    out = write_random_qwen3_family(out_dir, QWEN3_5_MOE_SIZES, qwen3_5_moe_config, seed=seed,
                                    max_pixels=max_pixels, size=size, readable=readable)
    write_fused_experts(out, QWEN3_5_MOE_SIZES[size]["text"]["num_experts"])
    return out


def write_fused_experts(out: Path, num_experts: int) -> None:
    """Rewrite the ``*.safetensors`` files under ``out`` with per-expert tensors (what ``save_pretrained`` writes)
    replaced by the released fused ones (``mlp.experts.gate_up_proj`` ``[E, 2I, hidden]``, ``down_proj``
    ``[E, hidden, I]``). A layer's experts must be in one file (as in a single-file checkpoint)."""
    from safetensors.torch import load_file, save_file

    from epdserve.models.qwen3_5_moe_lm import fuse_per_expert

    for file in sorted(out.glob("*.safetensors")):
        tensors = dict(fuse_per_expert(load_file(str(file)).items(), num_experts))
        save_file(tensors, str(file), metadata={"format": "pt"})
