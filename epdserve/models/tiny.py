"""Write a small, real-format Qwen2.5-VL / Qwen2-VL / Qwen3-VL checkpoint with random weights.

The checkpoint has the same files a Hugging Face hub checkpoint has (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files, ``processor_config.json``, chat template) so every loader in
epdserve is exercised on it. Nothing is downloaded: the byte-level BPE tokenizer is trained offline on a
fixed corpus and the weights come from a fixed seed, so two calls give identical checkpoints.

Why ``initializer_range`` 0.02 and fp32: with these settings the top-1/top-2 logit margins of greedy decoding
are far above kernel noise, which makes token-for-token parity tests with ``transformers`` sound
(see ``../shared/notes/qwen-vl-facts.md``).

Qwen3-VL's parts (config, processor, chat template) are in :mod:`epdserve.models.qwen3_vl_checkpoint`;
:func:`epdserve.models.presets.make_preset_model` writes checkpoints with the released models' shapes instead
(bf16, sharded, GBs), so GPU benchmarks pay the real compute and memory cost.
"""

from __future__ import annotations

from pathlib import Path

from epdserve.models.checkpoint_parts import (
    CHAT_TEMPLATE, build_tokenizer, save_random_model, special_token_ids, write_generation_config,
)

# Text-model sizes. "tiny" (~1M parameters) is for CPU tests; "small" (~100M, head_dim 128 as in real Qwen-VL
# models, so flashinfer's kernels apply) is for GPU runs and benchmarks.
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, mrope_section=[4, 6, 6], vision_depth=2, vision_hidden=64),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, mrope_section=[16, 24, 24], vision_depth=4, vision_hidden=256),
}

# Command-line spellings of the architectures (the released models' names) -> transformers' model types.
ARCH_ALIASES = {"qwen2.5-vl": "qwen2_5_vl", "qwen2-vl": "qwen2_vl", "qwen3-vl": "qwen3_vl", "qwen3.5": "qwen3_5",
                "qwen3-vl-moe": "qwen3_vl_moe", "qwen3.5-moe": "qwen3_5_moe"}
ARCHS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")


def normalize_arch(arch: str) -> str:
    """``arch`` as a transformers model type: ``qwen2.5-vl`` -> ``qwen2_5_vl`` etc.; model types pass through.

    Raises:
        ValueError: neither a model type of ``ARCHS`` nor an alias of ``ARCH_ALIASES``.
    """
    arch = ARCH_ALIASES.get(arch, arch)
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {list(ARCHS)} or {list(ARCH_ALIASES)}")
    return arch


def _build_config(arch: str, tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """The transformers config of a checkpoint, and its model and processor classes.

    ``text`` holds the text model's sizes; ``mrope_section`` (and the shared defaults: rope theta 1e6, RMS eps
    1e-6, ``initializer_range`` 0.02) become the config's rope settings. ``vision`` holds the vision tower's
    sizes, completed with the settings every Qwen-VL tower shares (patch 14, merge 2, temporal patch 2).

    Raises:
        ValueError: unknown ``arch``.
    """
    special = special_token_ids(tokenizer)
    text = dict(text)
    text_config = dict(
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": text.pop("mrope_section", [16, 24, 24])},
        bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
        **text,
    )
    vision_config = dict(in_chans=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                         initializer_range=0.02, **vision)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model
        from transformers import Qwen2_5_VLProcessor as Processor
    elif arch == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model
        from transformers import Qwen2VLProcessor as Processor
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen2_5_vl' or 'qwen2_vl'")
    config = Config(text_config=text_config, vision_config=vision_config, initializer_range=0.02,
                    tie_word_embeddings=tie_word_embeddings, **special)
    return config, Model, Processor


def _write_generation_and_processor(out: Path, tokenizer, processor_cls, *, min_pixels: int,
                                    max_pixels: int) -> None:
    """Write ``generation_config.json``, the tokenizer, the processor config and the chat template to ``out``."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    write_generation_config(out, tokenizer)
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    processor = processor_cls(image_processor=image_processor, tokenizer=tokenizer,
                              video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def make_tiny_model(out_dir: str | Path, *, arch: str = "qwen2_5_vl", seed: int = 0, max_pixels: int | None = None,
                    size: str = "tiny", readable: bool = False) -> Path:
    """Write a ~1M-parameter Qwen-VL checkpoint to ``out_dir`` and return its path.

    Weights are fp32, from transformers' own initialization under ``torch.manual_seed(seed)``. For checkpoints
    with the real models' shapes see :func:`epdserve.models.presets.make_preset_model`.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        arch: ``"qwen2_5_vl"``, ``"qwen2_vl"`` or ``"qwen3_vl"`` (or an alias of ``ARCH_ALIASES``, e.g.
            ``"qwen3-vl"``), or ``"qwen3_5"`` (``"qwen3.5"``: the hybrid LM, sizes ``tiny`` and ``small``, see
            :mod:`epdserve.models.qwen3_5_checkpoint`). Qwen3-VL:
            :func:`epdserve.models.qwen3_vl_checkpoint.make_tiny_qwen3_vl` (its own sizes, patch 16, DeepStack from
            two vision blocks; ``max_pixels`` defaults to ``512 * 32**2`` there). ``"qwen3_vl_moe"``
            (``"qwen3-vl-moe"``, size ``tiny`` only): :mod:`epdserve.models.qwen3_vl_moe_checkpoint`;
            ``"qwen3_5_moe"`` (``"qwen3.5-moe"``, tiny only): :mod:`epdserve.models.qwen3_5_checkpoint`.
        size: ``"tiny"`` or ``"small"`` (see ``SIZES``).
        seed: seed of the random weights.
        max_pixels: image processor ``longest_edge`` in pixels; bounds image tokens per image to
            ``max_pixels / 28**2`` (Qwen2/2.5-VL; None: ``512 * 28**2``).
        readable: zero the LM-head rows of ids that do not decode to visible text (as the presets do), so greedy
            answers are readable gibberish rather than lone bytes shown as U+FFFD; EOS is then never picked.
            The default served model (:func:`epdserve.models.paths.default_model_path`) is made this way; the
            test checkpoints are not.

    Raises:
        ValueError: unknown ``arch`` or ``size``.
    """
    arch = normalize_arch(arch)
    if arch == "qwen3_vl":
        from epdserve.models.qwen3_vl_checkpoint import make_tiny_qwen3_vl

        return make_tiny_qwen3_vl(out_dir, seed=seed, size=size, readable=readable,
                                  **({} if max_pixels is None else {"max_pixels": max_pixels}))
    if arch == "qwen3_5":
        from epdserve.models.qwen3_5_checkpoint import make_tiny_qwen3_5

        return make_tiny_qwen3_5(out_dir, seed=seed, size=size, readable=readable,
                                 **({} if max_pixels is None else {"max_pixels": max_pixels}))
    if arch == "qwen3_5_moe":
        from epdserve.models.qwen3_5_checkpoint import make_tiny_qwen3_5_moe

        return make_tiny_qwen3_5_moe(out_dir, seed=seed, size=size, readable=readable,
                                     **({} if max_pixels is None else {"max_pixels": max_pixels}))
    if arch == "qwen3_vl_moe":
        from epdserve.models.qwen3_vl_moe_checkpoint import make_tiny_qwen3_vl_moe

        return make_tiny_qwen3_vl_moe(out_dir, seed=seed, size=size, readable=readable,
                                      **({} if max_pixels is None else {"max_pixels": max_pixels}))
    max_pixels = 512 * 28 * 28 if max_pixels is None else max_pixels
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    dims = dict(SIZES[size])
    vision_depth, vision_hidden = dims.pop("vision_depth"), dims.pop("vision_hidden")
    hidden = dims["hidden_size"]
    text = dict(vocab_size=len(tokenizer), max_position_embeddings=4096, **dims)
    if arch == "qwen2_5_vl":
        vision = dict(depth=vision_depth, num_heads=4, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                      out_hidden_size=hidden, fullatt_block_indexes=[vision_depth - 1], window_size=112,
                      tokens_per_second=2)
    else:
        vision = dict(depth=vision_depth, num_heads=4, embed_dim=vision_hidden, mlp_ratio=2, hidden_size=hidden)
    config, model_cls, processor_cls = _build_config(arch, tokenizer, text=text, vision=vision,
                                                     tie_word_embeddings=False)
    save_random_model(out, model_cls, config, tokenizer, seed=seed, readable=readable)
    _write_generation_and_processor(out, tokenizer, processor_cls, min_pixels=56 * 56, max_pixels=max_pixels)
    return out
