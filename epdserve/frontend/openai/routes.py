"""The OpenAI protocol: ``POST /v1/chat/completions``, ``POST /v1/completions`` (legacy: a prompt in, no chat
template) and ``GET /v1/models``, as one router over a server's :class:`~epdserve.frontend.serving.RequestPath`."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.native.generate import completion_events, completion_json
from epdserve.frontend.openai.protocol import (
    ChatCompletionChunk, ChatCompletionRequest, ChunkChoice, CompletionRequest, Delta, ModelCard, ModelList,
)
from epdserve.frontend.serving import Call, RequestPath
from epdserve.frontend.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall


async def no_auth() -> None:
    """The dependency of a server without an API key."""


def chat_call(chat: ChatService, rid: str, req: ChatCompletionRequest) -> Call:
    """The :class:`Call` of a chat completion request."""

    async def complete(prepared: PreparedChat) -> dict:
        return (await chat.complete(prepared)).model_dump()

    def as_event(body: dict) -> str:
        choice = body["choices"][0]
        calls = [DeltaToolCall(index=i, id=c["id"], type="function", function=DeltaFunctionCall(**c["function"]))
                 for i, c in enumerate(choice["message"].get("tool_calls") or [])]
        return ChatCompletionChunk(id=rid, created=body["created"], model=chat.model_name, choices=[ChunkChoice(
            delta=Delta(role="assistant", content=choice["message"]["content"], tool_calls=calls or None),
            finish_reason=choice["finish_reason"])]).model_dump_json()

    return Call(lambda deadline: chat.prepare(rid, req, deadline), req.stream, chat.stream, complete, as_event)


def completion_call(chat: ChatService, rid: str, req: CompletionRequest) -> Call:
    """The :class:`Call` of a (legacy) completion request."""
    return Call(lambda deadline: chat.prepare_ids(rid, req.as_generate(), deadline), req.stream,
                lambda p: completion_events(chat, p, req), lambda p: completion_json(chat, p, req), json.dumps)


def openai_router(path: RequestPath, authorize: Callable = no_auth) -> APIRouter:
    """The OpenAI routes of ``path``'s server, each behind ``authorize`` (a FastAPI dependency)."""
    router = APIRouter(dependencies=[Depends(authorize)])
    server = path.server

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=server.model_name, root=server.model_path, max_model_len=server.max_model_len())
        return JSONResponse(ModelList(data=[card]).model_dump())

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await path.serve(request, ChatCompletionRequest, lambda rid, req: chat_call(server.chat, rid, req))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's legacy completions: a prompt (text or token ids) in, no chat template."""
        return await path.serve(request, CompletionRequest,
                                lambda rid, req: completion_call(server.chat, rid, req))

    return router
