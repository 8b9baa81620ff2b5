"""The OpenAI protocol: ``POST /v1/chat/completions``, ``POST /v1/completions`` (legacy: a prompt in, no chat
template) and ``GET /v1/models``, as one router over a server's :class:`~epdserve.frontend.serving.RequestPath`."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from epdserve.frontend.openai.chat import ChatCompletion
from epdserve.frontend.openai.completions import completion_call
from epdserve.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from epdserve.frontend.serving import RequestPath, no_auth


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
        return await path.serve(request, ChatCompletionRequest,
                                lambda rid, req: ChatCompletion(server.chat, rid, req).call())

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's legacy completions: a prompt (text or token ids) in, no chat template."""
        return await path.serve(request, CompletionRequest,
                                lambda rid, req: completion_call(server.chat, rid, req))

    return router
