"""The pieces every generated test checkpoint shares: the offline byte-level BPE tokenizer with Qwen-VL's
special tokens, their ids for a config, ``generation_config.json``, and which LM-head rows to zero so greedy output
stays readable. Used by :mod:`epdserve.models.tiny` (Qwen2/2.5-VL), :mod:`epdserve.models.qwen3_vl_checkpoint` and
:mod:`epdserve.models.presets`."""

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


def special_token_ids(tokenizer) -> dict[str, int]:
    """The config's special token ids (image/video pad, vision start/end, bos/eos/pad) in ``tokenizer``."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def write_generation_config(out: Path, tokenizer) -> None:
    """Write ``generation_config.json`` as the released Qwen-VL checkpoints have it: eos ``<|im_end|>`` and
    ``<|endoftext|>``, which is also bos and pad."""
    from transformers import GenerationConfig

    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(
        bos_token_id=pad,
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), pad],
        pad_token_id=pad,
    ).save_pretrained(out)


def _is_visible_text(text: str) -> bool:
    """Non-empty, no U+FFFD (a lone UTF-8 byte), only printable characters or whitespace, and not all whitespace."""
    return (bool(text.strip()) and "\ufffd" not in text
            and all(c.isprintable() or c.isspace() for c in text))


def invisible_ids(tokenizer, vocab: int, keep: set[int] = frozenset()) -> list[int]:
    """Ids below ``vocab`` that are past the tokenizer or do not decode (``skip_special_tokens=True``) to visible
    text, except those in ``keep``: the LM-head rows to zero so that greedy output stays readable (a zero row's
    logit is exactly 0, below the top of the random rows)."""
    visible = {i for i in range(min(len(tokenizer), vocab))
               if _is_visible_text(tokenizer.decode([i], skip_special_tokens=True))}
    return sorted(set(range(vocab)) - visible - set(keep))


def save_random_model(out: Path, model_cls, config, tokenizer, *, seed: int, readable: bool) -> None:
    """Write ``model_cls(config)`` with the weights ``torch.manual_seed(seed)`` gives, in float32, to ``out``
    (safetensors). ``readable``: zero the LM-head rows of tokens that decode to nothing visible
    (:func:`invisible_ids`), so greedy output stays text."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if readable:
        with torch.no_grad():
            model.lm_head.weight[invisible_ids(tokenizer, config.text_config.vocab_size)] = 0
    model.save_pretrained(out, safe_serialization=True)
