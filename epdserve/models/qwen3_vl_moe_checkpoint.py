"""The Qwen3-VL-MoE parts of epdserve's random-weight checkpoints: config and tiny model (``make-tiny-model --arch
qwen3-vl-moe``); :mod:`epdserve.models.presets` uses :func:`qwen3_vl_moe_config` for ``qwen3-vl-30b-a3b``.

The architecture is transformers 5's ``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL's tower (DeepStack) and
decoder, whose MLPs are sparse blocks of routed experts (:mod:`epdserve.models.qwen3_vl_moe_lm`). Processor, chat
template and tokenizer are Qwen3-VL's (:func:`~epdserve.models.qwen3_vl_checkpoint.write_qwen3_vl_processor`).

The released Qwen/Qwen3-VL-30B-A3B-Instruct ``config.json`` (three public copies agree, read 2026-11 with the
code-search tools: a Rust test transcribing the fetched file "byte-for-byte" at hub commit ``1fc78ad``, a Swift test's
real-shape config, and Megatron launch arguments): text 48 layers of 2048, 32 query / 4 KV heads of 128, 128 experts,
top-8, ``moe_intermediate_size`` 768, ``decoder_sparse_step`` 1, ``mlp_only_layers`` [] (every layer sparse, so the
dense ``intermediate_size`` 6144 is never built), no shared experts, rope theta 5e6, interleaved mrope_section
[24, 20, 20], vocabulary 151936, 262144 positions, untied head; tower 27 blocks of 1152, MLP 4304, 16 heads,
DeepStack from blocks 8, 16, 24, out 2048. The released checkpoint stores the experts transposed
(``gate_up_proj`` ``[E, hidden, 2I]``, ``down_proj`` ``[E, I, hidden]``), and so do these (see
:func:`write_released_expert_layout`).
"""

from __future__ import annotations

from pathlib import Path

# tiny: the released ratios at width 128: 8 query heads per KV head (32 : 4), heads * head_dim twice the width
# (32 x 128 over 2048), mrope_section [24, 20, 20] / 4; 32 experts top-2 (128 : 8 = 16 experts per chosen one),
# moe_intermediate 3/8 of the width (768 / 2048), every layer sparse. Three layers and the tiny Qwen3-VL tower
# (DeepStack from blocks 0 and 1 of three).
QWEN3_VL_MOE_SIZES = {
    "tiny": dict(text=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=8,
                           num_key_value_heads=1, head_dim=32, mrope_section=[6, 5, 5], num_experts=32,
                           num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
                           mlp_only_layers=[]),
                 vision=dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=4,
                             deepstack_visual_indexes=[0, 1])),
}


def qwen3_vl_moe_config(tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """``(Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)`` for the given sizes: ``text`` holds the text
    sizes (the expert keys among them), completed as :func:`~epdserve.models.qwen3_vl_checkpoint.qwen3_vl_config`
    completes Qwen3-VL's (rope theta 5e6, interleaved M-RoPE, no attention bias, ``initializer_range`` 0.02; the
    tower's patch 16 etc.)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from epdserve.models.qwen3_vl_checkpoint import qwen3_vl_family_config

    return qwen3_vl_family_config(Qwen3VLMoeConfig, tokenizer, text=text, vision=vision,
                                  tie_word_embeddings=tie_word_embeddings), Qwen3VLMoeForConditionalGeneration


def is_fused_expert(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a fused expert tensor (``...mlp.experts.gate_up_proj`` or
    ``...mlp.experts.down_proj``), which the released checkpoint stores transposed."""
    return name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def write_released_expert_layout(out: Path) -> None:
    """Rewrite the ``*.safetensors`` files under ``out`` (as ``save_pretrained`` wrote them: experts in
    transformers' in-memory layout ``[E, 2I, hidden]`` / ``[E, hidden, I]``) with every fused expert tensor
    transposed to the released layout ``[E, hidden, 2I]`` / ``[E, I, hidden]``; other tensors unchanged."""
    from safetensors.torch import load_file, save_file

    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(file))
        tensors = {k: v.transpose(1, 2).contiguous() if is_fused_expert(k) else v for k, v in tensors.items()}
        save_file(tensors, str(file), metadata={"format": "pt"})


def make_tiny_qwen3_vl_moe(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 512 * 32 * 32,
                           size: str = "tiny", readable: bool = False) -> Path:
    """Write a small random-weight Qwen3-VL-MoE checkpoint (fp32, transformers' own init under
    ``torch.manual_seed(seed)``, experts in the released transposed layout) to ``out_dir`` and return its path; see
    :func:`epdserve.models.tiny.make_tiny_model` for ``readable`` and ``max_pixels``.

    Raises:
        ValueError: unknown ``size`` (see ``QWEN3_VL_MOE_SIZES``).
    """
    from epdserve.models.qwen3_vl_checkpoint import write_random_qwen3_family

    out = write_random_qwen3_family(out_dir, QWEN3_VL_MOE_SIZES, qwen3_vl_moe_config, seed=seed,
                                    max_pixels=max_pixels, size=size, readable=readable)
    write_released_expert_layout(out)
    return out
