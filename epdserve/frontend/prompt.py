"""OpenAI messages -> token ids with image slots, exactly as the Hugging Face processor would build them.

The gateway never sees pixels, so it cannot call the processor on images. It gets each image's token count from
the encoder instead and does the processor's own text expansion: the i-th ``<|image_pad|>`` in the chat-template
text becomes ``num_tokens_i`` copies. The text between image slots is tokenized while the encoder works
(:meth:`PromptBuilder.tokenize_template`) and the image runs are spliced in once the counts are known
(:meth:`PromptBuilder.splice`). That equals tokenizing the expanded text at once, as the processor does, because
``<|image_pad|>`` is a special token: the tokenizer splits the text at every special token before anything else,
so no token spans a slot (``tests/test_gateway.py`` checks the ids against the processor's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epdserve.frontend.protocol import ChatMessage, ImagePart, TextPart
from epdserve.wire.messages import ImageSpan


class PromptError(ValueError):
    """The messages cannot make a prompt (image count mismatch, bad role or content). Maps to HTTP 400."""


@dataclass(frozen=True)
class EncodedImage:
    """What the encoder reports for one image: its cache key, token count and patch grid (before merging)."""

    image_hash: str
    num_tokens: int
    grid_thw: list[int]


@dataclass(frozen=True)
class VideoInput:
    """One video of a request as the encoder takes it: the file's bytes (mp4, webm, ... as the client sent them)
    and the frame sampling asked for (``mm_processor_kwargs``; None: the checkpoint's video processor default, see
    :func:`epdserve.models.video_layout.frame_sampler`). Its key is :func:`epdserve.hashing.video_key`."""

    data: bytes
    fps: float | None = None
    num_frames: int | None = None


@dataclass
class TemplatePieces:
    """A chat-template text cut at its image slots, each piece tokenized: ``piece_ids[i]`` comes before image
    ``i`` (the last piece after the last image)."""

    text: str
    piece_ids: list[list[int]]


@dataclass
class Prompt:
    """A tokenized prompt. ``images[i]`` locates the i-th image's tokens in ``input_ids``."""

    input_ids: list[int]
    images: list[ImageSpan]
    text: str  # the chat-template text before image expansion (for logs and debugging)


def to_hf_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[str]]:
    """Convert OpenAI messages to the chat-template format and collect image URLs in prompt order.

    Image parts become ``{"type": "image"}``, text parts ``{"type": "text", "text": ...}``; string content stays a
    string; ``developer`` becomes ``system``; ``None`` content becomes ``""``.

    Returns:
        ``(hf_messages, image_urls)`` where ``image_urls[i]`` is the i-th image of the prompt.
    """
    hf: list[dict[str, Any]] = []
    urls: list[str] = []
    for msg in messages:
        role = "system" if msg.role == "developer" else msg.role
        if msg.content is None or isinstance(msg.content, str):
            hf.append({"role": role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for part in msg.content:
            if isinstance(part, ImagePart):
                parts.append({"type": "image"})
                urls.append(part.image_url.url)
            elif isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
        hf.append({"role": role, "content": parts})
    return hf, urls


class PromptBuilder:
    """Builds prompts with one model's processor (chat template, tokenizer, image token).

    Not thread-safe: a fast tokenizer may reconfigure itself per call ("Already borrowed" under concurrency), so
    callers run :meth:`build` from one thread at a time.
    """

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = getattr(processor, "image_token", None) or "<|image_pad|>"
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)

    @classmethod
    def from_pretrained(cls, model_path: str) -> PromptBuilder:
        """Load the processor of the local checkpoint ``model_path`` (never downloads)."""
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(model_path, local_files_only=True))

    def template(self, hf_messages: list[dict[str, Any]]) -> str:
        """The chat-template text with the generation prompt appended, image slots unexpanded."""
        return self.processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)

    def build(self, hf_messages: list[dict[str, Any]], images: list[EncodedImage]) -> Prompt:
        """Tokenize ``hf_messages`` with ``images[i]`` expanded at the i-th image slot (see :meth:`splice`)."""
        return self.splice(self.tokenize_template(hf_messages), images)

    def tokenize_template(self, hf_messages: list[dict[str, Any]]) -> TemplatePieces:
        """Apply the chat template and tokenize the text between image slots (no image counts needed yet)."""
        text = self.template(hf_messages)
        pieces = text.split(self.image_token)
        ids = self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        return TemplatePieces(text=text, piece_ids=[list(p) for p in ids])

    def splice(self, pieces: TemplatePieces, images: list[EncodedImage]) -> Prompt:
        """The prompt: ``pieces`` with ``images[i].num_tokens`` image tokens at the i-th slot.

        Raises:
            PromptError: the template has a different number of image slots than ``images`` (for example a text
                part that spells out the image token), or the image runs in the ids do not match the counts.
        """
        if len(pieces.piece_ids) - 1 != len(images):
            raise PromptError(f"the prompt has {len(pieces.piece_ids) - 1} image slots but {len(images)} images "
                              f"(is {self.image_token!r} written in a text part?)")
        input_ids = list(pieces.piece_ids[0])
        for img, piece in zip(images, pieces.piece_ids[1:]):
            input_ids += [self.image_token_id] * img.num_tokens
            input_ids += piece
        text = pieces.text
        runs = _runs(input_ids, self.image_token_id)
        if len(runs) != len(images) or any(n != img.num_tokens for (_, n), img in zip(runs, images)):
            # Adjacent image slots with nothing between them would merge into one run; the Qwen-VL template
            # always wraps each slot in vision_start/vision_end, so this is a template we do not support.
            raise PromptError("image tokens in the prompt do not line up with the images")
        spans = [ImageSpan(offset=off, length=n, image_hash=img.image_hash, grid_thw=list(img.grid_thw))
                 for (off, n), img in zip(runs, images)]
        return Prompt(input_ids=input_ids, images=spans, text=text)


def _runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == token_id:
            j = i
            while j < n and ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
