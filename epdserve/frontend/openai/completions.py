"""OpenAI's (legacy) ``/v1/completions``: a prompt in (text or token ids, no chat template), a ``text_completion``
out (OpenAI's shape; ``token_ids``/``prompt_token_ids`` with ``return_token_ids``, as vLLM), streamed as text deltas
with an optional usage event. ``n > 1``: ``n`` choices, streamed with their ``index``; the usage sums the choices'
completion tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.choices import collect_choices
from epdserve.frontend.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from epdserve.frontend.request import PromptRequest, bias_pairs, stop_list
from epdserve.frontend.serving import Call
from epdserve.frontend.structured import generate_grammar
from epdserve.wire.messages import SamplingParams


async def prompt_request(req: CompletionRequest) -> PromptRequest:
    """``req`` (its :meth:`~CompletionRequest.unsupported` said None) in the core's terms, the grammar of its
    ``structured_outputs`` checked.

    Raises:
        APIError: 400 for a grammar xgrammar rejects.
    """
    grammar = await generate_grammar(None, None, None, req.structured_outputs)
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
        stop=stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        seed=req.seed, frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        logit_bias=bias_pairs(req.logit_bias), grammar=grammar, n=req.n)
    text, ids = req.one_prompt()
    return PromptRequest(sampling, text, ids, 16 if req.max_tokens is None else req.max_tokens)


def completion_call(service: ChatService, rid: str, req: CompletionRequest) -> Call:
    """The :class:`Call` of a (legacy) completion request."""

    async def prepare(deadline: float | None) -> PreparedChat:
        return await service.prepare_ids(rid, await prompt_request(req), deadline)

    return Call(prepare, req.stream, lambda p: completion_events(service, p, req),
                lambda p: completion_json(service, p, req), json.dumps)


async def completion_json(service: ChatService, chat: PreparedChat, req: CompletionRequest) -> dict[str, Any]:
    """Run ``chat`` to the end; the ``text_completion`` JSON body.

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    async with aclosing(service.outputs(chat)) as outputs:
        results = await collect_choices(outputs, chat.prefill.sampling.n)
    rti = req.return_token_ids
    choices = [CompletionChoice(index=r.index, text=r.text, finish_reason=r.final.finish_reason,
                                token_ids=r.token_ids if rti else None) for r in results]
    return CompletionResponse(id=chat.rid, model=service.model_name, choices=choices,
                              usage=service.usage(chat, results[-1].final, sum(len(r.token_ids) for r in results)),
                              prompt_token_ids=chat.prompt.input_ids if rti else None).model_dump()


def completion_events(service: ChatService, chat: PreparedChat, req: CompletionRequest) -> AsyncIterator[str]:
    """The streamed ``text_completion`` events of ``chat``: text deltas, the finish, the usage event when
    ``stream_options.include_usage``, then ``[DONE]``; a failure once streaming has begun becomes an error event
    (:meth:`ChatService.sse`). Closing it aborts the request."""
    created, rti = int(time.time()), req.return_token_ids

    def event(choices: list[CompletionChoice], **extra) -> str:
        body = CompletionResponse(id=chat.rid, created=created, model=service.model_name, choices=choices, **extra)
        return f"data: {body.model_dump_json()}\n\n"

    async def events() -> AsyncIterator[str]:
        n_out = 0
        async with aclosing(service.outputs(chat)) as outputs:
            async for text, final in outputs:
                n_out += len(final.token_ids)
                if text or final.finish_reason is not None or (rti and final.token_ids):
                    yield event([CompletionChoice(index=final.index, text=text, finish_reason=final.finish_reason,
                                                  token_ids=final.token_ids if rti else None)])
        if req.stream_options and req.stream_options.include_usage:
            yield event([], usage=service.usage(chat, final, n_out))

    return service.sse(chat, events())
