"""Answers of the two prompt-in APIs (no chat template), for a request prepared by ``ChatService.prepare_ids``:
SGLang's native ``/generate`` and OpenAI's (legacy) ``/v1/completions``.

Shapes follow SGLang's ``/generate`` (``sglang/srt/entrypoints/http_server.py``): ``{"text", "output_ids",
"meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``,
where ``finish_reason`` is ``{"type": "length", "length": n}``, ``{"type": "stop", "matched": null}`` (epdserve
does not report which stop matched) or null while running. Streamed, each SSE event carries the text and ids so
far (SGLang's default, not deltas), then ``data: [DONE]``.

``/v1/completions`` answers a ``text_completion`` object (OpenAI's shape; ``token_ids``/``prompt_token_ids`` with
``return_token_ids``, as vLLM), streamed as text deltas with an optional usage event. Both are used by the gateway
and by the prefill/decode HTTP fronts behind a PD router.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from epdserve.gateway.chat import APIError, ChatService, PreparedChat
from epdserve.gateway.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from epdserve.messages import TokenOutput


def _meta_info(chat: PreparedChat, final: TokenOutput | None, n_out: int, t0: float) -> dict[str, Any]:
    finish = None
    if final is not None and final.finish_reason == "length":
        finish = {"type": "length", "length": final.completion_tokens or n_out}
    elif final is not None and final.finish_reason == "stop":
        finish = {"type": "stop", "matched": None}
    return {"id": chat.rid, "finish_reason": finish,
            "prompt_tokens": (final.prompt_tokens if final else 0) or len(chat.prompt.input_ids),
            "completion_tokens": (final.completion_tokens if final else 0) or n_out,
            "cached_tokens": final.cached_tokens if final else 0, "e2e_latency": time.monotonic() - t0}


async def generate_json(service: ChatService, chat: PreparedChat) -> dict[str, Any]:
    """Run ``chat`` to the end; the ``/generate`` JSON body.

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    t0 = time.monotonic()
    texts, ids, final = [], [], None
    async for text, final in service.outputs(chat):
        texts.append(text)
        ids += final.token_ids
    return {"text": "".join(texts), "output_ids": ids, "meta_info": _meta_info(chat, final, len(ids), t0)}


async def generate_events(service: ChatService, chat: PreparedChat) -> AsyncIterator[str]:
    """The ``/generate`` SSE events of ``chat``; a failure once streaming has begun becomes an
    ``{"error": {"message", "code"}}`` event before ``[DONE]``. Closing the iterator early aborts the request."""
    t0 = time.monotonic()
    text, ids = "", []
    try:
        async for delta, out in service.outputs(chat):
            text += delta
            ids += out.token_ids
            body = {"text": text, "output_ids": ids, "meta_info": _meta_info(chat, out, len(ids), t0)}
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps({'error': {'message': e.message, 'code': e.status}}, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


def _usage(chat: PreparedChat, final: TokenOutput | None, n_out: int) -> Usage:
    return Usage.of((final.prompt_tokens if final else 0) or len(chat.prompt.input_ids),
                    (final.completion_tokens if final else 0) or n_out, final.cached_tokens if final else 0)


async def completion_json(service: ChatService, chat: PreparedChat, req: CompletionRequest) -> dict[str, Any]:
    """Run ``chat`` to the end; the ``text_completion`` JSON body.

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    texts, ids, final = [], [], None
    async for text, final in service.outputs(chat):
        texts.append(text)
        ids += final.token_ids
    rti = req.return_token_ids
    choice = CompletionChoice(text="".join(texts), finish_reason=final.finish_reason, token_ids=ids if rti else None)
    return CompletionResponse(id=chat.rid, model=service.model_name, choices=[choice],
                              usage=_usage(chat, final, len(ids)),
                              prompt_token_ids=chat.prompt.input_ids if rti else None).model_dump()


async def completion_events(service: ChatService, chat: PreparedChat, req: CompletionRequest) -> AsyncIterator[str]:
    """The streamed ``text_completion`` events of ``chat``: text deltas, the finish, the usage event when
    ``stream_options.include_usage``, then ``[DONE]``; a failure once streaming has begun becomes an error event."""
    created, n_out, final = int(time.time()), 0, None
    rti = req.return_token_ids

    def event(choices: list[CompletionChoice], **extra) -> str:
        body = CompletionResponse(id=chat.rid, created=created, model=service.model_name, choices=choices, **extra)
        return f"data: {body.model_dump_json()}\n\n"

    try:
        async for text, final in service.outputs(chat):
            n_out += len(final.token_ids)
            if text or final.finish_reason is not None or (rti and final.token_ids):
                yield event([CompletionChoice(text=text, finish_reason=final.finish_reason,
                                              token_ids=final.token_ids if rti else None)])
    except APIError as e:
        yield f"data: {e.body().model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
        return
    if req.stream_options and req.stream_options.include_usage:
        yield event([], usage=_usage(chat, final, n_out))
    yield "data: [DONE]\n\n"
