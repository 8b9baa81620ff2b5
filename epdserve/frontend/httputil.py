"""HTTP plumbing every epdserve front end shares: request parsing, client-disconnect handling, a streaming
response that reports its end, and the uvicorn settings."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from epdserve.frontend.errors import APIError, ClientGone

if TYPE_CHECKING:
    import uvicorn

T = TypeVar("T")

# How long an idle keep-alive connection stays open, in seconds: longer than any client pool's own idle expiry
# (httpx and the openai SDK 5 s, aiohttp 15 s). A client starts that clock once it has closed a response, later
# than the server did, so at uvicorn's default (5 s, httpx's too) a loaded httpx pool reused connections the gateway
# was closing at that moment, and those requests died unanswered (ReadError; a POST is not retried).
KEEP_ALIVE_S = 120


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that calls ``on_close()`` once it is over, however it ended (sent, client gone,
    never started): the request's lifetime ends exactly then."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientGone` (the request's
    lifetime then aborts it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the only message left to receive is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def parse_request(body: bytes, schema: type[BaseModel], model_name: str | None):
    """``body`` validated as ``schema`` (a request model with ``unsupported()``) and checked against the served
    ``model_name`` (None: the schema names no model, as SGLang's ``/generate``).

    Raises:
        APIError: 400 for a schema error or an unsupported feature, 404 for another model.
    """
    try:
        req = schema.model_validate_json(body)
    except ValidationError as e:
        raise APIError(400, describe_validation_error(e), param=first_error_param(e)) from None
    if model_name is not None and req.model != model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    if (problem := req.unsupported()) is not None:
        raise APIError(400, problem)
    return req


def describe_validation_error(e: ValidationError) -> str:
    """A short message naming the first three schema errors of a request body (for a 400 answer)."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
    return "invalid request: " + "; ".join(parts) + more


def first_error_param(e: ValidationError) -> str | None:
    """The top-level request field of the first schema error, for the OpenAI error's ``param``."""
    errors = e.errors()
    return str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None


def server_config(app: FastAPI | None, host: str, port: int,
                  graceful_shutdown_s: float | None = None) -> uvicorn.Config:
    """The uvicorn settings every epdserve HTTP server (the gateway, the prefill/decode fronts) serves ``app``
    with on ``host``:``port``; ``graceful_shutdown_s``: how long open requests may finish on shutdown (None: no
    limit)."""
    import uvicorn

    # loop="asyncio" even where uvloop is installed: the encoder client is grpc.aio, and under uvloop a CI run saw
    # image requests outlive a killed encoder (its health probe never timed out). The HTTP parser is httptools.
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, loop="asyncio",
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=graceful_shutdown_s)
