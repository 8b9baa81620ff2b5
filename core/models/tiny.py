"""Write a small, real-format Qwen2.5-VL / Qwen2-VL checkpoint with random weights.

The checkpoint has the same files a Hugging Face hub checkpoint has (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files, ``processor_config.json``, chat template) so every loader in
epdserve is exercised on it. Nothing is downloaded: the byte-level BPE tokenizer is trained offline on a
fixed corpus and the weights come from a fixed seed, so two calls give identical checkpoints.

Why ``initializer_range`` 0.02 and fp32: with these settings the top-1/top-2 logit margins of greedy decoding
are far above kernel noise, which makes token-for-token parity tests with ``transformers`` sound
(see ``../shared/notes/qwen-vl-facts.md``).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen2-VL / Qwen2.5-VL chat template, as shipped with the instruct checkpoints.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split pattern (from the Qwen2 tokenizer.json).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = """\
You are a helpful assistant. Describe this image. What is in the picture? The photo shows a cat sitting on a
table next to a cup of coffee. An astronaut in an orange suit smiles at the camera in front of a flag. A rocket
lifts off from the launch pad with a bright plume of smoke and fire. The page is a scanned document with printed
text in several columns. A man holds a camera on a tripod in a park on a sunny day. Please answer briefly.
How many objects are there? What colour is the cup? Where was this taken? Tell me a story about the picture.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } , . ; : ! ? " ' # @ % & _
"""


def build_tokenizer(vocab_size: int = 1536):
    """Train a byte-level BPE tokenizer with Qwen2's split regex and the Qwen-VL special tokens.

    Returns a ``transformers.PreTrainedTokenizerFast`` (eos ``<|im_end|>``, pad ``<|endoftext|>``) carrying the
    Qwen-VL chat template. Deterministic: the corpus and trainer settings are fixed.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


# Text-model sizes. "tiny" (~1M parameters) is for CPU tests; "small" (~100M, head_dim 128 as in real Qwen-VL
# models, so flashinfer's kernels apply) is for GPU runs and benchmarks.
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, mrope_section=[4, 6, 6], vision_depth=2, vision_hidden=64),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, mrope_section=[16, 24, 24], vision_depth=4, vision_hidden=256),
}


def make_tiny_model(out_dir: str | Path, *, arch: str = "qwen2_5_vl", seed: int = 0, max_pixels: int = 512 * 28 * 28,
                    size: str = "tiny") -> Path:
    """Write a ~1M-parameter Qwen-VL checkpoint to ``out_dir`` and return its path.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        arch: ``"qwen2_5_vl"`` or ``"qwen2_vl"``.
        size: ``"tiny"`` or ``"small"`` (see ``SIZES``).
        seed: seed of the random weights.
        max_pixels: image processor ``longest_edge`` in pixels; bounds image tokens per image to
            ``max_pixels / 28**2``.

    Raises:
        ValueError: unknown ``arch`` or ``size``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    dims = dict(SIZES[size])
    vision_depth, vision_hidden = dims.pop("vision_depth"), dims.pop("vision_hidden")
    hidden = dims["hidden_size"]
    text_config = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": dims.pop("mrope_section")},
        **dims,
    )
    vision_common = dict(depth=vision_depth, num_heads=4, in_chans=3, patch_size=14, spatial_merge_size=2,
                         temporal_patch_size=2, initializer_range=0.02)
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    text_config.update(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"],
                       pad_token_id=special["pad_token_id"])
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model
        from transformers import Qwen2_5_VLProcessor as Processor

        vision_config = dict(vision_common, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                             out_hidden_size=hidden, fullatt_block_indexes=[vision_depth - 1], window_size=112,
                             tokens_per_second=2)
    elif arch == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model
        from transformers import Qwen2VLProcessor as Processor

        vision_config = dict(vision_common, embed_dim=vision_hidden, mlp_ratio=2, hidden_size=hidden)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen2_5_vl' or 'qwen2_vl'")

    config = Config(text_config=text_config, vision_config=vision_config, initializer_range=0.02,
                    tie_word_embeddings=False, **special)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=special["bos_token_id"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=special["pad_token_id"],
    ).save_pretrained(out)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=max_pixels)
    video_processor = Qwen2VLVideoProcessor()
    processor = Processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                          chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def default_model_path() -> Path:
    """The tiny Qwen2.5-VL checkpoint used when no ``--model-path`` is given, created once.

    It lives in ``$EPDSERVE_CACHE`` (default ``~/.cache/epdserve``). Concurrent first calls are safe: each
    writes to a private temporary directory and the first rename wins.
    """
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("EPDSERVE_CACHE", Path.home() / ".cache" / "epdserve"))
    target = root / "tiny-qwen2.5-vl"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-"))
    make_tiny_model(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model_path: str) -> str:
    """``""`` -> the default tiny model; otherwise the given local directory.

    Raises:
        FileNotFoundError: ``model_path`` is not a directory with a ``config.json``.
    """
    if not model_path:
        return str(default_model_path())
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"{model_path!r} is not a local Hugging Face checkpoint (no config.json); "
                                "epdserve never downloads models")
    return model_path
