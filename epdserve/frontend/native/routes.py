"""SGLang's native protocol: ``POST /generate`` (text or token ids in, no chat template; answers in
:mod:`epdserve.frontend.native.generate`), as a router over a server's
:class:`~epdserve.frontend.serving.RequestPath`."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.native.generate import generate_events, generate_json, prompt_request
from epdserve.frontend.native.protocol import GenerateRequest
from epdserve.frontend.serving import Call, RequestPath, no_auth


def generate_call(chat: ChatService, rid: str, req: GenerateRequest) -> Call:
    """The :class:`Call` of a ``/generate`` request."""

    async def prepare(deadline: float | None) -> PreparedChat:
        return await chat.prepare_ids(rid, await prompt_request(req), deadline)

    return Call(prepare, req.stream, lambda p: generate_events(chat, p), lambda p: generate_json(chat, p),
                json.dumps)


def native_router(path: RequestPath, authorize: Callable = no_auth) -> APIRouter:
    """``POST /generate`` of ``path``'s server, behind ``authorize`` (a FastAPI dependency)."""
    router = APIRouter(dependencies=[Depends(authorize)])

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        """SGLang's native API: text or token ids in, no chat template (see ``epdserve.frontend.native.generate``)."""
        return await path.serve(request, GenerateRequest, lambda rid, req: generate_call(path.server.chat, rid, req))

    return router
