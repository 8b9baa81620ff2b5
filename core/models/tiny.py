"""Write a small, real-format Qwen2.5-VL / Qwen2-VL checkpoint with random weights.

The checkpoint has the same files a Hugging Face hub checkpoint has (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files, ``processor_config.json``, chat template) so every loader in
epdserve is exercised on it. Nothing is downloaded: the byte-level BPE tokenizer is trained offline on a
fixed corpus and the weights come from a fixed seed, so two calls give identical checkpoints.

Why ``initializer_range`` 0.02 and fp32: with these settings the top-1/top-2 logit margins of greedy decoding
are far above kernel noise, which makes token-for-token parity tests with ``transformers`` sound
(see ``../shared/notes/qwen-vl-facts.md``).

:func:`make_preset_model` writes checkpoints with the released models' shapes instead (``PRESETS``: bf16,
sharded, GBs), so GPU benchmarks pay the real compute and memory cost.
"""

from __future__ import annotations

import hashlib
import json
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

# The real checkpoints' shapes (their config.json files), for random-weight checkpoints with the real cost.
# qwen2.5-vl-3b is untied here although the released 3B ties its head: the baseline this preset reproduces
# measured the untied model (3.40B LM parameters).
_QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
PRESETS = {
    "qwen2.5-vl-3b": dict(
        arch="qwen2_5_vl", tie_word_embeddings=False,
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=128000),
        vision=dict(_QWEN25_VISION, out_hidden_size=2048)),
    "qwen2.5-vl-7b": dict(
        arch="qwen2_5_vl", tie_word_embeddings=False,
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, head_dim=128, max_position_embeddings=128000),
        vision=dict(_QWEN25_VISION, out_hidden_size=3584)),
    "qwen2-vl-2b": dict(
        arch="qwen2_vl", tie_word_embeddings=True,
        text=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768),
        vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536)),
}
# The image processor of the released checkpoints (preprocessor_config.json).
PRESET_MIN_PIXELS, PRESET_MAX_PIXELS = 56 * 56, 12845056
_MAX_SHARD_BYTES = 2 * 1000**3


def _build_config(arch: str, tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """The transformers config of a checkpoint, and its model and processor classes.

    ``text`` holds the text model's sizes; ``mrope_section`` (and the shared defaults: rope theta 1e6, RMS eps
    1e-6, ``initializer_range`` 0.02) become the config's rope settings. ``vision`` holds the vision tower's
    sizes, completed with the settings every Qwen-VL tower shares (patch 14, merge 2, temporal patch 2).

    Raises:
        ValueError: unknown ``arch``.
    """
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
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
    from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(
        bos_token_id=pad,
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), pad],
        pad_token_id=pad,
    ).save_pretrained(out)
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    processor = processor_cls(image_processor=image_processor, tokenizer=tokenizer,
                              video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def make_tiny_model(out_dir: str | Path, *, arch: str = "qwen2_5_vl", seed: int = 0, max_pixels: int = 512 * 28 * 28,
                    size: str = "tiny", readable: bool = False) -> Path:
    """Write a ~1M-parameter Qwen-VL checkpoint to ``out_dir`` and return its path.

    Weights are fp32, from transformers' own initialization under ``torch.manual_seed(seed)``. For checkpoints
    with the real models' shapes see :func:`make_preset_model`.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        arch: ``"qwen2_5_vl"`` or ``"qwen2_vl"``.
        size: ``"tiny"`` or ``"small"`` (see ``SIZES``).
        seed: seed of the random weights.
        max_pixels: image processor ``longest_edge`` in pixels; bounds image tokens per image to
            ``max_pixels / 28**2``.
        readable: zero the LM-head rows of ids that do not decode to visible text (as the presets do), so greedy
            answers are readable gibberish rather than lone bytes shown as U+FFFD; EOS is then never picked.
            The default served model (:func:`default_model_path`) is made this way; the test checkpoints are not.

    Raises:
        ValueError: unknown ``arch`` or ``size``.
    """
    import torch

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
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if readable:
        with torch.no_grad():
            model.lm_head.weight[_invisible_ids(tokenizer, config.text_config.vocab_size)] = 0
    model.save_pretrained(out, safe_serialization=True)
    _write_generation_and_processor(out, tokenizer, processor_cls, min_pixels=56 * 56, max_pixels=max_pixels)
    return out


def _is_visible_text(text: str) -> bool:
    """Non-empty, no U+FFFD (a lone UTF-8 byte), only printable characters or whitespace, and not all whitespace."""
    return (bool(text.strip()) and "\ufffd" not in text
            and all(c.isprintable() or c.isspace() for c in text))


def _invisible_ids(tokenizer, vocab: int, keep: set[int] = frozenset()) -> list[int]:
    """Ids below ``vocab`` that are past the tokenizer or do not decode (``skip_special_tokens=True``) to visible
    text, except those in ``keep``: the LM-head rows to zero so that greedy output stays readable (a zero row's
    logit is exactly 0, below the top of the random rows)."""
    visible = {i for i in range(min(len(tokenizer), vocab))
               if _is_visible_text(tokenizer.decode([i], skip_special_tokens=True))}
    return sorted(set(range(vocab)) - visible - set(keep))


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from ``seed`` and a tensor name, stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_kind(module, param_name: str) -> str:
    """``"normal"``, ``"zeros"`` or ``"ones"``: what transformers' ``PreTrainedModel._init_weights`` does to one
    parameter of ``module`` (linear/conv weights and embeddings normal, their biases 0, norm weights 1 and
    norm biases 0).

    Raises:
        ValueError: a module kind ``_init_weights`` treats otherwise (so a new layer type is not silently wrong).
    """
    from torch import nn

    name = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)):
        return "zeros" if param_name == "bias" else "normal"
    if "LayerNorm" in name or "RMSNorm" in name:
        return "zeros" if param_name == "bias" else "ones"
    raise ValueError(f"no random init rule for parameter {param_name!r} of {name}")


def _tensor_plan(model) -> list[tuple[str, str, tuple[int, ...], str, int | None]]:
    """``(saved name, in-memory name, shape, init kind, embedding padding_idx)`` of every tensor that
    ``save_pretrained`` would write for ``model`` (a meta-device model): tied copies left out, names in the
    checkpoint layout that transformers writes (``model.layers.*``, ``visual.*``, ``lm_head.weight``).

    Raises:
        ValueError: see :func:`_init_kind`; a name that transformers' reverse renaming maps to != 1 name.
    """
    from torch import nn
    from transformers.core_model_loading import revert_weight_conversion

    tied = set(model.all_tied_weights_keys)
    plan = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if name in tied:
                continue
            saved = list(revert_weight_conversion(model, {name: param}))
            if len(saved) != 1:
                raise ValueError(f"{name} saves as {saved}; expected one name")
            padding_idx = module.padding_idx if isinstance(module, nn.Embedding) else None
            plan.append((saved[0], name, tuple(param.shape), _init_kind(module, param_name), padding_idx))
    return plan


def make_preset_model(out_dir: str | Path, preset: str, *, seed: int = 0, device: str = "cpu",
                      overrides: dict | None = None) -> Path:
    """Write a random-weight checkpoint with the shapes of a released Qwen-VL model and return its path.

    ``preset`` is one of ``PRESETS`` (``qwen2.5-vl-3b``, ``qwen2.5-vl-7b``, ``qwen2-vl-2b``): the real text and
    vision sizes and vocabulary size (151936 / 152064 rows, more than the offline tokenizer's ~550 ids: only
    the shapes matter), and the released image processor (``min_pixels`` 3136, ``max_pixels`` 12845056, so a
    1280x720 image gives 1196 image tokens). Tokenizer, processor, chat template and generation config are the
    same as :func:`make_tiny_model`'s.

    Weights: the HF model class is built on the ``meta`` device only for the tensor names and shapes; each
    tensor is then drawn directly in bfloat16 on ``device`` from its own generator, seeded by ``seed`` and a
    SHA-256 of the tensor's checkpoint name, with transformers' ``_init_weights`` rules (linear/conv weights and
    embeddings ~ N(0, 0.02), the embedding's padding row 0, biases 0, norm weights 1). Files: safetensors shards
    of at most 2 GB with ``model.safetensors.index.json``. The same ``seed``, ``device`` and ``overrides`` give
    byte-identical files; the CPU and CUDA generators differ, so cpu and cuda give different weights.

    Readable output: random weights would make greedy decoding emit special tokens, ids past the tokenizer
    and lone UTF-8 bytes. So the LM-head row of every id whose ``tokenizer.decode([id],
    skip_special_tokens=True)`` is not visible text (empty, as for special tokens; all whitespace; containing
    U+FFFD or a non-printable character), and of every id >= ``len(tokenizer)``, is set to 0: its logit is
    exactly 0 while visible ids' logits are random with std ~0.9 (sqrt(hidden) * 0.02), so greedy decoding
    streams visible text (and never EOS: run with a length limit). Untied models zero rows of ``lm_head.weight``.
    In a tied model (``qwen2-vl-2b``) the head IS the input embedding, so the zeroed rows also zero those ids'
    input embeddings, which is harmless for ids that never appear in prompts; the special tokens prompts use
    (``<|im_start|>``, ``<|image_pad|>``, ... all of ``SPECIAL_TOKENS``) keep their embedding rows there. The
    count of zeroed rows is written to ``epdserve_preset.json`` (preset, seed, device, overrides, parameters).

    Args:
        out_dir: target directory (created; existing files are overwritten).
        preset: a key of ``PRESETS``.
        seed: seed of the random weights.
        device: where the weights are drawn (``"cpu"``, ``"cuda"``, ``"cuda:1"``; CUDA is much faster). At most
            one 2 GB shard is held in host memory at a time.
        overrides: for tests only: ``{"text": {...}, "vision": {...}}`` merged into the preset's sizes (e.g.
            ``{"text": {"num_hidden_layers": 1}, "vision": {"depth": 1}}``).

    Raises:
        ValueError: unknown ``preset`` or unknown override section.
        RuntimeError: ``device`` is CUDA and CUDA is not available (from torch).
    """
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    overrides = overrides or {}
    if set(overrides) - {"text", "vision"}:
        raise ValueError(f"overrides may have 'text' and 'vision' only, got {sorted(overrides)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tie = spec["tie_word_embeddings"]
    config, model_cls, processor_cls = _build_config(
        spec["arch"], tokenizer, text={**spec["text"], **overrides.get("text", {})},
        vision={**spec["vision"], **overrides.get("vision", {})}, tie_word_embeddings=tie)
    with torch.device("meta"):
        meta_model = model_cls(config)
    plan = _tensor_plan(meta_model)
    head = meta_model.all_tied_weights_keys.get("lm_head.weight", "lm_head.weight")
    if head not in {name for _, name, *_ in plan}:
        raise ValueError(f"no LM head tensor {head!r} in {model_cls.__name__}")
    del meta_model

    vocab = config.text_config.vocab_size
    # In a tied model the head is the input embedding: prompts' special tokens must keep their rows.
    keep = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} if tie else set()
    zero_rows = torch.tensor(_invisible_ids(tokenizer, vocab, keep), dtype=torch.long)

    # Shards in model order, each at most _MAX_SHARD_BYTES (a larger single tensor gets its own shard).
    nbytes = {entry[0]: 2 * int(torch.Size(entry[2]).numel()) for entry in plan}  # bf16: 2 bytes a value
    shards: list[list] = [[]]
    size = 0
    for entry in plan:
        if shards[-1] and size + nbytes[entry[0]] > _MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes[entry[0]]
    for old in out.glob("model*.safetensors*"):  # a previous, differently sharded checkpoint
        old.unlink()

    dev = torch.device(device)
    # Older transformers 5 releases keep initializer_range only in the sub-configs.
    std = getattr(config, "initializer_range", None) or config.text_config.initializer_range
    total_bytes = sum(nbytes.values())
    weight_map = {}
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"{preset} weights") as bar:
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for saved, name, shape, kind, padding_idx in shard:
                gen = torch.Generator(device=dev).manual_seed(_tensor_seed(seed, saved))
                if kind == "normal":
                    t = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, std,
                                                                                     generator=gen)
                    if padding_idx is not None:
                        t[padding_idx] = 0
                else:
                    t = (torch.ones if kind == "ones" else torch.zeros)(shape, dtype=torch.bfloat16, device=dev)
                if name == head:
                    t[zero_rows.to(dev)] = 0
                tensors[saved] = t.cpu()
                weight_map[saved] = file
                bar.update(nbytes[saved])
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    num_params = total_bytes // 2
    index = {"metadata": {"total_parameters": num_params, "total_size": total_bytes},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    config.architectures = [model_cls.__name__]
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    _write_generation_and_processor(out, tokenizer, processor_cls, min_pixels=PRESET_MIN_PIXELS,
                                    max_pixels=PRESET_MAX_PIXELS)
    note = {"preset": preset, "seed": seed, "device": dev.type, "overrides": overrides or None,
            "num_parameters": num_params, "zeroed_lm_head_rows": len(zero_rows),
            "zeroed_rows_note": "LM-head rows of ids that do not decode to visible text (and ids past the "
                                "tokenizer) are 0, so greedy decoding emits visible text"}
    (out / "epdserve_preset.json").write_text(json.dumps(note, indent=2) + "\n")
    return out


def default_model_path() -> Path:
    """The tiny Qwen2.5-VL checkpoint used when no ``--model-path`` is given, created once, with readable
    greedy answers (``make_tiny_model(readable=True)``).

    It lives in ``$EPDSERVE_CACHE`` (default ``~/.cache/epdserve``). Concurrent first calls are safe: each
    writes to a private temporary directory and the first rename wins.
    """
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("EPDSERVE_CACHE", Path.home() / ".cache" / "epdserve"))
    target = root / "tiny-qwen2.5-vl-readable"  # a new name: caches of the older, unreadable default stay unused
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-"))
    make_tiny_model(tmp, readable=True)
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
