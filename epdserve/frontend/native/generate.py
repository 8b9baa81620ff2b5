"""Answers of the two prompt-in APIs (no chat template), for a request prepared by ``ChatService.prepare_ids``:
SGLang's native ``/generate`` and OpenAI's (legacy) ``/v1/completions``.

Shapes follow SGLang's ``/generate`` (``sglang/srt/entrypoints/http_server.py``): ``{"text", "output_ids",
"meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``,
where ``finish_reason`` is ``{"type": "length", "length": n}``, ``{"type": "stop", "matched": null}`` (epdserve
does not report which stop matched) or null while running. Streamed, each SSE event carries the text and ids so
far (SGLang's default, not deltas), then ``data: [DONE]``; a failure once streaming has begun is an OpenAI-style
``{"error": {...}}`` event, as on every streamed route.

``/v1/completions`` answers a ``text_completion`` object (OpenAI's shape; ``token_ids``/``prompt_token_ids`` with
``return_token_ids``, as vLLM), streamed as text deltas with an optional usage event. Both are used by the gateway
and by the prefill/decode HTTP fronts behind a PD router.

``n > 1`` (``sampling_params.n``, ``n``): ``/generate`` answers a list of ``n`` bodies (SGLang's shape), each
``meta_info`` counting its own choice's tokens; streamed, each event carries its choice's ``index``. The completion
has ``n`` choices, streamed with their ``index``; its usage sums the choices' completion tokens.
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
from epdserve.wire.messages import TokenOutput


def _meta_info(service: ChatService, chat: PreparedChat, out: TokenOutput, n_out: int, t0: float) -> dict[str, Any]:
    finish = None
    if out.finish_reason == "length":
        finish = {"type": "length", "length": out.completion_tokens or n_out}
    elif out.finish_reason == "stop":
        finish = {"type": "stop", "matched": None}
    return {"id": chat.rid, "finish_reason": finish, "prompt_tokens": out.prompt_tokens or len(chat.prompt.input_ids),
            "completion_tokens": out.completion_tokens or n_out, "cached_tokens": out.cached_tokens,
            "e2e_latency": time.monotonic() - t0}


async def generate_json(service: ChatService, chat: PreparedChat) -> dict[str, Any] | list[dict[str, Any]]:
    """Run ``chat`` to the end; the ``/generate`` JSON body (a list of one per choice when ``n > 1``).

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    t0 = time.monotonic()
    async with aclosing(service.outputs(chat)) as outputs:
        results = await collect_choices(outputs, chat.prefill.sampling.n)
    bodies = [{"text": r.text, "output_ids": r.token_ids,
               "meta_info": _meta_info(service, chat, r.final, len(r.token_ids), t0)} for r in results]
    return bodies if len(bodies) > 1 else bodies[0]


def generate_events(service: ChatService, chat: PreparedChat) -> AsyncIterator[str]:
    """The ``/generate`` SSE events of ``chat``, each with the text and ids so far, then ``[DONE]``; a failure
    once streaming has begun becomes an error event (:meth:`ChatService.sse`). Closing it aborts the request."""

    async def events() -> AsyncIterator[str]:
        t0, n = time.monotonic(), chat.prefill.sampling.n
        texts, ids = [""] * n, [[] for _ in range(n)]
        async with aclosing(service.outputs(chat)) as outputs:
            async for delta, out in outputs:
                i = out.index
                texts[i] += delta
                ids[i] += out.token_ids
                body = {"text": texts[i], "output_ids": ids[i],
                        "meta_info": _meta_info(service, chat, out, len(ids[i]), t0)}
                if n > 1:
                    body["index"] = i
                yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    return service.sse(chat, events())


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
