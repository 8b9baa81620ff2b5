"""Chat messages -> token ids with image and video slots, exactly as the Hugging Face processor would build them.

The gateway never sees pixels, so it cannot call the processor on images. It gets each image's token count from
the encoder instead and does the processor's own text expansion: the i-th ``<|image_pad|>`` in the chat-template
text becomes ``num_tokens_i`` copies. The text between image slots is tokenized while the encoder works
(:meth:`PromptBuilder.tokenize_template`) and the image runs are spliced in once the counts are known
(:meth:`PromptBuilder.splice`). That equals tokenizing the expanded text at once, as the processor does, because
``<|image_pad|>`` is a special token: the tokenizer splits the text at every special token before anything else,
so no token spans a slot (``tests/test_gateway.py`` checks the ids against the processor's).

Videos: the i-th ``<|video_pad|>`` becomes the processor's own placeholder text for the i-th video
(``replace_video_token``: pads for Qwen2/2.5-VL; timestamped runs of pads for Qwen3-VL), planned from the file's
metadata (:mod:`epdserve.frontend.video_slots`) and tokenized with the template; ``<|video_pad|>`` is special too,
and the placeholder's text sits between special tokens, so the same argument holds
(``tests/test_video_prompt.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from epdserve.frontend.tool_prompt import hermes_messages, renders_tools
from epdserve.models.video_layout import VideoLayout, video_mrope_entries
from epdserve.wire.messages import ImageSpan


class PromptError(ValueError):
    """The messages cannot make a prompt (image or video count mismatch, bad role or content). Maps to HTTP 400."""


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


@dataclass(frozen=True)
class VideoSlot:
    """One video of a request, planned from its metadata (:func:`epdserve.frontend.video_slots.video_slot`).

    Attributes:
        input: what the encoder takes (bytes and the requested sampling).
        encoded: what the encoder must report for it: key :func:`epdserve.hashing.video_key`, ``num_tokens`` =
            all its embedding rows (``t * h * w / merge**2``), ``grid_thw`` ``[t, h, w]`` in patches.
        layout: frames, grid and timing.
        placeholder: the text standing for the video in the chat-template text (transformers'
            ``processor.replace_video_token``).
    """

    input: VideoInput
    encoded: EncodedImage
    layout: VideoLayout
    placeholder: str


@dataclass
class TemplatePieces:
    """A chat-template text cut at its image and video slots, each piece tokenized: ``piece_ids[i]`` comes before
    slot ``i`` (the last piece after the last slot); ``kinds[i]`` is slot ``i``'s kind ("image" or "video");
    ``video_ids[j]`` is the tokenized placeholder of video ``j`` (when given to
    :meth:`PromptBuilder.tokenize_template`)."""

    text: str
    piece_ids: list[list[int]]
    kinds: list[str] = field(default_factory=list)
    video_ids: list[list[int]] = field(default_factory=list)


@dataclass
class Prompt:
    """A tokenized prompt. ``images[i]`` locates the i-th image's tokens in ``input_ids``."""

    input_ids: list[int]
    images: list[ImageSpan]  # every image's span and every video's span(s), in prompt order
    text: str  # the chat-template text before image expansion (for logs and debugging)


class PromptBuilder:
    """Builds prompts with one model's processor (chat template, tokenizer, image and video tokens).

    Args:
        processor: the checkpoint's ``AutoProcessor``.
        model_config: its ``transformers`` config (``model_type``; Qwen2.5-VL's ``vision_config.tokens_per_second``),
            needed for videos only (their spans depend on the architecture).

    Not thread-safe: a fast tokenizer may reconfigure itself per call ("Already borrowed" under concurrency), so
    callers run :meth:`build` from one thread at a time.
    """

    def __init__(self, processor: Any, model_config: Any = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = getattr(processor, "image_token", None) or "<|image_pad|>"
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token: str = getattr(processor, "video_token", None) or "<|video_pad|>"
        self.video_token_id: int = self.tokenizer.convert_tokens_to_ids(self.video_token)
        self.model_config = model_config
        self._slot = re.compile(f"({re.escape(self.image_token)}|{re.escape(self.video_token)})")
        self._renders_tools: bool | None = None  # probed on first use (tool_prompt.renders_tools)

    @classmethod
    def from_pretrained(cls, model_path: str) -> PromptBuilder:
        """Load the processor and config of the local checkpoint ``model_path`` (never downloads)."""
        from transformers import AutoConfig, AutoProcessor

        return cls(AutoProcessor.from_pretrained(model_path, local_files_only=True),
                   AutoConfig.from_pretrained(model_path, local_files_only=True))

    def template(self, hf_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat-template text with the generation prompt appended, image and video slots unexpanded.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries) go to the template when it renders
        tools; otherwise they, and any tool calls and results in the history, are written into the messages as
        the Qwen2.5 template would (:func:`epdserve.frontend.tool_prompt.hermes_messages`).
        """
        if self._renders_tools is None:
            self._renders_tools = renders_tools(self.processor)
        if not self._renders_tools:
            hf_messages, tools = hermes_messages(hf_messages, tools), None
        return self.processor.apply_chat_template(hf_messages, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)

    def build(self, hf_messages: list[dict[str, Any]], images: list[EncodedImage],
              videos: Sequence[VideoSlot] = ()) -> Prompt:
        """Tokenize ``hf_messages`` with ``images[i]`` expanded at the i-th image slot and ``videos[j]`` at the
        j-th video slot (see :meth:`splice`)."""
        return self.splice(self.tokenize_template(hf_messages, [v.placeholder for v in videos]), images, videos)

    def tokenize_template(self, hf_messages: list[dict[str, Any]], video_placeholders: Sequence[str] = (),
                          tools: list[dict[str, Any]] | None = None) -> TemplatePieces:
        """Apply the chat template (with ``tools``, see :meth:`template`) and tokenize the text between slots (no
        image counts needed yet), and each video's placeholder text (:attr:`VideoSlot.placeholder`)."""
        text = self.template(hf_messages, tools)
        cut = self._slot.split(text)  # pieces at even indices, the slot tokens between them
        pieces, slots = cut[0::2], cut[1::2]
        ids = self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        video_ids = self.tokenizer(list(video_placeholders), add_special_tokens=False)["input_ids"] \
            if video_placeholders else []
        kinds = ["image" if s == self.image_token else "video" for s in slots]
        return TemplatePieces(text, [list(p) for p in ids], kinds, [list(v) for v in video_ids])

    def splice(self, pieces: TemplatePieces, images: list[EncodedImage], videos: Sequence[VideoSlot] = ()) -> Prompt:
        """The prompt: ``pieces`` with ``images[i].num_tokens`` image tokens at the i-th image slot and the
        tokenized placeholder of ``videos[j]`` at the j-th video slot; one span per image, and per video one span
        (Qwen2/2.5-VL, grid ``[t, h, w]``) or one per temporal patch (Qwen3-VL, grid ``[1, h, w]``, with
        ``embed_offset``), all ``video=True`` with the video's key.

        Raises:
            PromptError: the template has a different number of image or video slots than ``images``/``videos``
                (for example a text part that spells out the image token), or the image or video runs in the ids
                do not match the counts.
        """
        kinds = pieces.kinds or ["image"] * (len(pieces.piece_ids) - 1)
        n_img = kinds.count("image")
        if n_img != len(images) or len(kinds) - n_img != len(videos):
            raise PromptError(f"the prompt has {n_img} image slots and {len(kinds) - n_img} video slots but "
                              f"{len(images)} images and {len(videos)} videos (is {self.image_token!r} or "
                              f"{self.video_token!r} written in a text part?)")
        if len(pieces.video_ids) != len(videos):
            raise PromptError("the videos' placeholders were not tokenized with the template")
        input_ids = list(pieces.piece_ids[0])
        spans: list[ImageSpan] = []
        todo_images, todo_videos = iter(images), iter(zip(videos, pieces.video_ids))
        for kind, piece in zip(kinds, pieces.piece_ids[1:]):
            if kind == "image":
                input_ids += [self.image_token_id] * next(todo_images).num_tokens
            else:
                video, ids = next(todo_videos)
                spans += self._video_spans(video, ids, len(input_ids))
                input_ids += ids
            input_ids += piece
        runs = _runs(input_ids, self.image_token_id)
        if len(runs) != len(images) or any(n != img.num_tokens for (_, n), img in zip(runs, images)):
            # Adjacent image slots with nothing between them would merge into one run; the Qwen-VL template
            # always wraps each slot in vision_start/vision_end, so this is a template we do not support.
            raise PromptError("image tokens in the prompt do not line up with the images")
        if sum(s.length for s in spans) != input_ids.count(self.video_token_id):
            raise PromptError("video tokens in the prompt do not line up with the videos")
        spans += [ImageSpan(offset=off, length=n, image_hash=img.image_hash, grid_thw=list(img.grid_thw))
                  for (off, n), img in zip(runs, images)]
        return Prompt(input_ids=input_ids, images=sorted(spans, key=lambda s: s.offset), text=pieces.text)

    def _video_spans(self, video: VideoSlot, ids: list[int], start: int) -> list[ImageSpan]:
        """The spans of ``video`` whose placeholder ``ids`` start at prompt offset ``start``: the M-RoPE entries
        transformers' ``get_rope_index`` gives its runs (:func:`video_mrope_entries`), each with its rows of the
        video's embedding (rows in token order, so a run's first row is the video tokens before it).

        Raises:
            PromptError: no model config, or runs that do not fit the grid.
        """
        if self.model_config is None:
            raise PromptError("this prompt builder has no model config, so it cannot place videos")
        cfg, key, m = self.model_config, video.encoded.image_hash, self.processor.video_processor.merge_size
        tps = getattr(getattr(cfg, "vision_config", None), "tokens_per_second", 1.0) or 1.0
        runs = _runs(ids, self.video_token_id)
        try:
            entries = video_mrope_entries(cfg.model_type, [off for off, _ in runs], video.layout, tps)
        except ValueError as e:
            raise PromptError(f"video placeholder does not fit its grid: {e}") from None
        spans, row = [], 0
        for (off, n), (_, grid, *interval) in zip(runs, entries):
            if n * m * m != grid[0] * grid[1] * grid[2]:
                raise PromptError(f"a run of {n} video tokens does not fit grid {grid}")
            spans.append(ImageSpan(offset=start + off, length=n, image_hash=key, grid_thw=list(grid), video=True,
                                   embed_offset=row, time_interval=float(interval[0]) if interval else 1.0))
            row += n
        if row != video.encoded.num_tokens:
            raise PromptError(f"the video's placeholder has {row} tokens, its plan {video.encoded.num_tokens}")
        return spans


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
