"""OpenAI's chat completions on the core's :class:`~epdserve.frontend.chat.ChatService`: a
:class:`ChatCompletionRequest` in the core's terms (chat-template messages, media URLs, sampling with the grammar
of ``response_format``/``structured_outputs`` or of the tools), and its answer as a ``chat.completion`` or as SSE
chunks (tool calls, log-probabilities, token ids).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.choices import collect_choices
from epdserve.frontend.openai.logprobs import logprob_content
from epdserve.frontend.openai.protocol import (
    AssistantMessage, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, Choice,
    ChoiceLogprobs, ChunkChoice, Delta, ImagePart, TextPart, VideoPart,
)
from epdserve.frontend.openai.response_format import chat_grammar
from epdserve.frontend.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall
from epdserve.frontend.openai.tools import ToolPlan, ToolStream, finish_reason, tool_message, tool_plan
from epdserve.frontend.request import ChatRequest, VideoSampling, bias_pairs
from epdserve.frontend.serving import Call
from epdserve.wire.messages import GrammarSpec, SamplingParams, TokenLogprob


def to_hf_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Convert OpenAI messages to the chat-template format and collect image and video URLs in prompt order.

    Image parts become ``{"type": "image"}``, video parts ``{"type": "video"}``, text parts ``{"type": "text",
    "text": ...}``; string content stays a string; ``developer`` becomes ``system``; ``None`` content becomes ``""``.
    An assistant message's ``tool_calls`` keep their ids with ``arguments`` as dicts, a tool message its
    ``tool_call_id`` (HF's tool-use format; see :mod:`epdserve.frontend.tool_prompt`).

    Returns:
        ``(hf_messages, image_urls, video_urls)``: ``image_urls[i]`` is the i-th image of the prompt,
        ``video_urls[j]`` its j-th video.
    """
    hf: list[dict[str, Any]] = []
    urls: list[str] = []
    video_urls: list[str] = []
    for msg in messages:
        role = "system" if msg.role == "developer" else msg.role
        extra: dict[str, Any] = {}
        if msg.role == "assistant" and msg.tool_calls:
            extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments_object()}} for c in msg.tool_calls]
        elif msg.role == "tool":
            extra = {"tool_call_id": msg.tool_call_id} | ({"name": msg.name} if msg.name else {})
        if msg.content is None or isinstance(msg.content, str):
            hf.append({"role": role, "content": msg.content or "", **extra})
            continue
        parts: list[dict[str, Any]] = []
        for part in msg.content:
            if isinstance(part, ImagePart):
                parts.append({"type": "image"})
                urls.append(part.image_url.url)
            elif isinstance(part, VideoPart):
                parts.append({"type": "video"})
                video_urls.append(part.video_url.url)
            elif isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
        hf.append({"role": role, "content": parts, **extra})
    return hf, urls, video_urls


def chat_request(req: ChatCompletionRequest, grammar: GrammarSpec | None, tools: ToolPlan | None) -> ChatRequest:
    """``req`` in the core's terms, with its checked ``grammar`` and its ``tools``' plan."""
    messages, image_urls, video_urls = to_hf_messages(req.messages)
    kwargs = req.mm_processor_kwargs
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logprobs=(req.top_logprobs or 0) if req.logprobs else -1,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=bias_pairs(req.logit_bias),
        grammar=grammar,
        n=req.n,
    )
    return ChatRequest(messages, sampling, image_urls, video_urls, req.requested_max_tokens(),
                       tools.functions if tools is not None else None,
                       VideoSampling(kwargs.fps, kwargs.num_frames) if kwargs is not None else None)


class ChatCompletion:
    """One chat completion request on a server's :class:`ChatService`: prepared in the core's terms, answered in
    OpenAI's (its tools decide how the text becomes content and tool calls).

    Args:
        service: the server's chat service.
        rid: the request id.
        req: the validated request.
    """

    def __init__(self, service: ChatService, rid: str, req: ChatCompletionRequest):
        self.service, self.rid, self.req = service, rid, req
        self.tools: ToolPlan | None = None  # the request's tools once prepared (None: none)

    def call(self) -> Call:
        """The :class:`Call` of this request."""

        async def complete(prepared: PreparedChat) -> dict:
            return (await self.complete(prepared)).model_dump()

        return Call(self.prepare, self.req.stream, self.stream, complete, self.as_event)

    async def prepare(self, deadline: float | None = None) -> PreparedChat:
        """Check the request's grammar and tools, then prepare it (``ChatService.prepare``).

        Raises:
            APIError: 400 for a bad ``response_format``, ``structured_outputs`` or tools, or as
                :meth:`ChatService.prepare`.
        """
        req = self.req
        grammar = await chat_grammar(req.response_format, req.structured_outputs)
        self.tools = await tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls is not False,
                                     grammar is not None)
        if self.tools is not None and self.tools.grammar is not None:
            grammar = self.tools.grammar
        return await self.service.prepare(self.rid, chat_request(req, grammar, self.tools), deadline)

    async def complete(self, chat: PreparedChat) -> ChatCompletionResponse:
        """Run ``chat`` to the end and build the ``chat.completion`` response.

        Raises:
            APIError: as :meth:`ChatService.outputs`.
        """
        service = self.service
        async with aclosing(service.outputs(chat)) as outputs:
            results = await collect_choices(outputs, chat.prefill.sampling.n)
        rti, choices = self.req.return_token_ids, []
        for r in results:  # tools and structured outputs apply per choice
            content, calls = tool_message(self.tools, r.text)
            choices.append(Choice(index=r.index, message=AssistantMessage(content=content, tool_calls=calls),
                                  finish_reason=finish_reason(r.final.finish_reason, bool(calls)),
                                  token_ids=r.token_ids if rti else None,
                                  logprobs=self._logprobs(r.token_ids, r.logprobs)))
        return ChatCompletionResponse(
            id=chat.rid, model=service.model_name, choices=choices,
            usage=service.usage(chat, results[-1].final, sum(len(r.token_ids) for r in results)),
            prompt_token_ids=chat.prompt.input_ids if rti else None)

    def stream(self, chat: PreparedChat) -> AsyncIterator[str]:
        """The SSE events of ``chat``: a role chunk, content chunks, a finish chunk, an optional usage chunk, then
        ``data: [DONE]``; a failure once streaming has begun becomes an error event (:meth:`ChatService.sse`).

        Closing the iterator early (client gone) aborts the request on the stages, and so does a stop string: the
        stream then ends with the text cut before it and ``finish_reason`` "stop".
        """
        return self.service.sse(chat, self._chunks(chat))

    async def _chunks(self, chat: PreparedChat) -> AsyncIterator[str]:
        service, created = self.service, int(time.time())
        rti = self.req.return_token_ids
        opts = self.req.stream_options

        def event(choices: list[ChunkChoice], **extra) -> str:
            chunk = ChatCompletionChunk(id=chat.rid, created=created, model=service.model_name, choices=choices,
                                        **extra)
            return f"data: {chunk.model_dump_json()}\n\n"

        n = chat.prefill.sampling.n
        for i in range(n):
            yield event([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))],
                        prompt_token_ids=chat.prompt.input_ids if rti else None)
        n_tokens = 0
        tools = [ToolStream(self.tools) for _ in range(n)]  # tool-call text becomes tool_calls deltas, not content
        async with aclosing(service.outputs(chat)) as outputs:
            async for text, final in outputs:
                n_tokens += len(final.token_ids)
                i = final.index
                text, calls = tools[i].feed(text, last=final.finish_reason is not None)
                if text or calls or final.token_ids and (rti or final.logprobs):
                    delta = Delta(content=text if text or not calls else None, tool_calls=calls)
                    yield event([ChunkChoice(index=i, delta=delta, token_ids=final.token_ids if rti else None,
                                             logprobs=self._logprobs(final.token_ids, final.logprobs))])
                if final.finish_reason is not None:  # each choice finishes on its own (OpenAI's, vLLM's)
                    yield event([ChunkChoice(index=i, delta=Delta(), finish_reason=finish_reason(
                        final.finish_reason, tools[i].called))])
        if opts and opts.include_usage:
            yield event([], usage=service.usage(chat, final, n_tokens))

    def as_event(self, body: dict) -> str:
        """A whole answer's body (:meth:`complete`'s, dumped) as one chunk's data (a PD prefill leg's streamed
        answer: its one token)."""
        choice = body["choices"][0]
        calls = [DeltaToolCall(index=i, id=c["id"], type="function", function=DeltaFunctionCall(**c["function"]))
                 for i, c in enumerate(choice["message"].get("tool_calls") or [])]
        return ChatCompletionChunk(id=self.rid, created=body["created"], model=self.service.model_name,
                                   choices=[ChunkChoice(delta=Delta(role="assistant",
                                                                    content=choice["message"]["content"],
                                                                    tool_calls=calls or None),
                                                        finish_reason=choice["finish_reason"])]).model_dump_json()

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> ChoiceLogprobs | None:
        """OpenAI's ``logprobs`` of a choice or chunk: None unless the request asked for them."""
        if not self.req.logprobs:
            return None
        return ChoiceLogprobs(content=logprob_content(self.service.token_bytes, token_ids, logprobs))
