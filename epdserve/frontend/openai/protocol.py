"""The OpenAI schema the servers speak: chat completions and (legacy) completions, their requests, responses and
stream chunks, and the model list (errors and ``usage`` are the core's: :mod:`epdserve.frontend.errors`,
:mod:`epdserve.frontend.request`).

Only what the gateway can honour is modelled. Unknown request fields are ignored (clients such as the OpenAI
SDK send fields like ``user``), but fields that would change the answer and are not implemented (``best_of``,
``repetition_penalty``, ``min_p``; ``logprobs`` outside chat completions) are rejected by each request's
``unsupported()`` rather than silently dropped. Extensions shared with vLLM/SGLang: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids``, ``structured_outputs`` (see :mod:`epdserve.frontend.structured`).
Tool calling: :mod:`epdserve.frontend.openai.tool_protocol` and :mod:`epdserve.frontend.openai.tools`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epdserve.frontend.openai.response_format import ResponseFormat
from epdserve.frontend.openai.tool_protocol import DeltaToolCall, HistoryToolCall, Tool, ToolCall, ToolChoice
from epdserve.frontend.request import (
    INT64_MAX, Int64, LogitBias, MaxTokens, Penalty, Seed, TokenId, Usage, stop_list,
)
from epdserve.frontend.structured import StructuredOutputs


def _is_none(value: object) -> bool:
    return value is None


# Extension fields are left out of the JSON when unset so plain OpenAI responses stay byte-for-byte familiar.
_Extension = Field(default=None, exclude_if=_is_none)


class ImageURL(BaseModel):
    """``{"url": ..., "detail": ...}``; ``detail`` is accepted and ignored (the processor picks the resolution)."""

    url: str
    detail: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


def _url_object(v):
    # Some clients send the URL as a bare string; accept it as the object form.
    return {"url": v} if isinstance(v, str) else v


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL

    _bare_url = field_validator("image_url", mode="before")(_url_object)


class VideoURL(BaseModel):
    """``{"url": ...}`` of a ``video_url`` part (vLLM's and SGLang's name): a ``data:video/...;base64`` URL, or
    ``http(s)://`` / ``file://`` where the server allows them."""

    url: str


class VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: VideoURL

    _bare_url = field_validator("video_url", mode="before")(_url_object)


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class MMProcessorKwargs(BaseModel):
    """A request's ``mm_processor_kwargs`` (vLLM's name): how its videos are sampled, at ``fps`` frames per second
    of playback or as ``num_frames`` frames spread over the clip (the video processor's ``sample_frames``); neither:
    the checkpoint's default (:func:`epdserve.models.video_layout.frame_sampler`). Any other key is refused."""

    model_config = ConfigDict(extra="forbid")

    fps: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    num_frames: int | None = Field(default=None, ge=1, le=INT64_MAX)

    @model_validator(mode="after")
    def _one_sampling(self) -> MMProcessorKwargs:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("give fps or num_frames, not both")
        return self


class ChatMessage(BaseModel):
    """One input message. ``developer`` (the newer OpenAI name for ``system``) is treated as ``system``; an
    assistant message may carry ``tool_calls``, and a ``tool`` message answers one (``tool_call_id``)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` body.

    ``max_completion_tokens`` is preferred over the legacy ``max_tokens`` when both are given. ``temperature``
    0 means greedy. ``top_k`` <= 0 disables top-k.
    """

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int64 | None = None
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # OpenAI's range
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[Tool] | None = None  # see epdserve.frontend.openai.tools
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    mm_processor_kwargs: MMProcessorKwargs | None = None

    def unsupported(self) -> str | None:
        """A message naming the first requested feature the gateway does not implement (or a field that needs
        another one), else None."""
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        return None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def stop_list(self) -> list[str]:
        return stop_list(self.stop)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _Extension


class TopLogprob(BaseModel):
    """One likely token at a step. ``token`` is its text (a token may hold part of a UTF-8 character: then
    ``token`` has U+FFFD and ``bytes`` the exact bytes to join with the neighbours')."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(TopLogprob):
    """A sampled token's log-probability and the ``top_logprobs`` most likely tokens at its step."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = _Extension


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = _Extension


class Delta(BaseModel):
    role: Literal["assistant"] | None = _Extension
    content: str | None = _Extension
    tool_calls: list[DeltaToolCall] | None = _Extension


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _Extension


class ChatCompletionChunk(BaseModel):
    """One SSE event. The usage chunk (``stream_options.include_usage``) has empty ``choices``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = _Extension
    prompt_token_ids: list[int] | None = _Extension


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "epdserve"
    root: str | None = _Extension
    max_model_len: int | None = _Extension


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- OpenAI's (legacy) completions: a prompt in, text out, no chat template --------------------------------

class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body: ``prompt`` is one string or one list of token ids (batches of prompts are
    refused). ``max_tokens`` defaults to 16, as in OpenAI's API and vLLM."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: MaxTokens | None = 16
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    n: int = Field(default=1, ge=1)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias = None
    structured_outputs: StructuredOutputs | None = None

    def _prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one string or one id list, or the elements of a batch of them."""
        batch = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list))
        return list(self.prompt) if batch else [self.prompt]

    def unsupported(self) -> str | None:
        """A message naming the first requested feature the gateway does not implement, else None."""
        if len(self._prompts()) != 1:
            return "a batch of prompts is not supported: send one prompt per request"
        if (self.best_of or self.n) != self.n:
            return "best_of other than n is not supported"
        if self.logprobs:
            return "logprobs are not supported"
        if self.echo or self.suffix:
            return "echo and suffix are not supported"
        return None

    def one_prompt(self) -> tuple[str | None, list[int] | None]:
        """``(text, input_ids)`` of the one prompt (call after :meth:`unsupported` said None)."""
        (prompt,) = self._prompts()
        return (prompt, None) if isinstance(prompt, str) else (None, prompt)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = _Extension


class CompletionResponse(BaseModel):
    """A ``text_completion`` answer, or (streamed) one event of it; the usage event has empty ``choices``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _Extension
    prompt_token_ids: list[int] | None = _Extension
