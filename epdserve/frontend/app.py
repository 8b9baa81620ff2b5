"""The one FastAPI app factory of every epdserve HTTP server (the gateway, the prefill and decode fronts).

The app starts its server in the background from its lifespan (so ``/health`` answers 503 while the server
loads), answers every error as OpenAI error JSON (schema errors and malformed JSON are 400, not FastAPI's 422;
under ``/v2`` the Open Inference Protocol's ``{"error": "message"}``),
serves ``GET /health/live`` (200 while the process answers at all) and whatever routers it is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from epdserve.frontend.errors import APIError
from epdserve.frontend.serving import Server


def create_app(server: Server, routers: Sequence[APIRouter], *, title: str, error_headers: bool = True,
               middleware: Sequence[type] = ()) -> FastAPI:
    """An app serving ``routers`` for ``server``; it runs ``server.start()`` in the background and
    ``server.close()`` on shutdown.

    Args:
        title: the app's title.
        error_headers: send an :class:`APIError`'s headers (``Retry-After``) with it; the PD fronts never have.
        middleware: ASGI middleware classes to add (each takes the app as its only argument).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        startup = asyncio.create_task(server.start())
        try:
            yield
        finally:
            startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await server.close()

    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    for cls in middleware:
        app.add_middleware(cls)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        path = request.url.path
        # The Open Inference Protocol's error shape on its routes (epdserve.frontend.kserve.http), OpenAI's elsewhere.
        body = {"error": e.message} if path == "/v2" or path.startswith("/v2/") else e.body().model_dump()
        return JSONResponse(body, status_code=e.status, headers=e.headers if error_headers else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return await _api_error(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return await _api_error(request, APIError(400, str(e.errors())))

    @app.get("/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    for router in routers:
        app.include_router(router)
    return app
