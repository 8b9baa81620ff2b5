"""A request and its usage in no protocol's terms: what a protocol package hands
:class:`~epdserve.frontend.chat.ChatService` once it has validated its own wire format, and the value ranges the
protocols' request schemas share.

A request is chat messages with their media (:class:`ChatRequest`, for ``ChatService.prepare``: the chat template
applies) or a prompt of text or token ids (:class:`PromptRequest`, for ``ChatService.prepare_ids``: no template),
plus the stages' own :class:`~epdserve.wire.messages.SamplingParams`. The protocol has already turned its
structured-output and tool fields into ``sampling.grammar`` (checked with xgrammar); the service checks what needs
the model (token ids against the vocabulary, ``n`` against ``--max-n``, the budget against the context length) and
sets ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, Field

from epdserve.wire.messages import SamplingParams

# Integers travel to the stages as msgpack int64 (a seed may use the unsigned range, as torch.manual_seed does).
INT64_MAX = (1 << 63) - 1
Int64 = Annotated[int, Field(ge=-(1 << 63), le=INT64_MAX)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=INT64_MAX)]
# OpenAI's range for presence/frequency penalties (vLLM's and SGLang's too).
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
# OpenAI's logit_bias: token ids (JSON object keys, so strings) -> a bias in [-100, 100] added to their logits.
LogitBias = dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None


def stop_list(stop: str | list[str] | None) -> list[str]:
    """A request's ``stop`` (one string, several, or none) as a list."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def bias_pairs(bias: dict[int, float] | None) -> list[list]:
    """A request's ``logit_bias`` as the stages take it: ``[token id, bias]`` pairs, by token id."""
    return [[t, b] for t, b in sorted((bias or {}).items())]


@dataclass(frozen=True)
class VideoSampling:
    """How a request's videos are sampled: ``fps`` frames per second of playback, or ``num_frames`` frames spread
    over the clip; neither: the checkpoint's default (:func:`epdserve.models.video_layout.frame_sampler`)."""

    fps: float | None = None
    num_frames: int | None = None


@dataclass
class ChatRequest:
    """Chat messages to answer, with the chat template.

    Attributes:
        messages: the messages in the chat template's format (Hugging Face's): an image part is ``{"type":
            "image"}``, a video part ``{"type": "video"}``.
        sampling: how to sample (``max_new_tokens`` is set from ``max_tokens``).
        image_urls: the URL of each image part, in prompt order (``data:`` URLs too).
        video_urls: the URL of each video part, in prompt order.
        max_tokens: the completion budget asked for; None: the server's default, up to the context length.
        tools: the functions the chat template renders (``tools=`` of ``apply_chat_template``); None: none.
        video_sampling: how the videos are sampled; None: the checkpoint's default.
    """

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    image_urls: list[str] = field(default_factory=list)
    video_urls: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    video_sampling: VideoSampling | None = None


@dataclass
class PromptRequest:
    """A prompt to continue, without a chat template: ``text`` (tokenized as is, with the tokenizer's own
    special-token rule) or ``input_ids``, exactly one of them.

    Attributes:
        sampling: how to sample (``max_new_tokens`` is set from ``max_tokens``).
        max_tokens: the completion budget asked for; None: the server's default, up to the context length.
    """

    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int | None = None


class PromptTokensDetails(BaseModel):
    """Where the prompt's tokens came from: ``cached_tokens`` had their KV in the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """A request's token counts (OpenAI's ``usage``, which the metrics record too). ``cached_tokens`` counts prompt
    tokens whose KV came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """The usage of ``prompt_tokens`` and ``completion_tokens``, ``cached_tokens`` of the prompt cached."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
