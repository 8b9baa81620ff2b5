"""The OpenAI-compatible HTTP front end: routes, auth, errors, client-disconnect handling, and ``main``.

Endpoints: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (readiness: 200 once the processor
is loaded, prefill and decode have answered and are up, and at least one encoder serves, else 503 with the reason;
``?details=1`` adds a JSON body with every stage's liveness and load, ``&fresh=1`` asks prefill and decode for their
load now), ``GET /health/live`` (liveness: 200 while the process answers at all), and ``GET /metrics``,
``/get_model_info``, ``/get_server_info`` (:mod:`epdserve.gateway.observability`). Every error is OpenAI error
JSON; schema errors and malformed JSON are 400 (not FastAPI's 422). Overload and stage failures answer 429/503
with ``Retry-After`` (see :mod:`epdserve.gateway.admission`), the request deadline 504.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from epdserve.config import GatewayConfig
from epdserve.gateway.admission import Admission, Overloaded
from epdserve.gateway.chat import APIError, ChatService
from epdserve.gateway.media import MediaPolicy
from epdserve.gateway.observability import ClosingStreamingResponse, RequestIds, add_observability_routes
from epdserve.gateway.prompt import PromptBuilder
from epdserve.gateway.generate import completion_events, completion_json, generate_events, generate_json
from epdserve.gateway.protocol import (
    ChatCompletionRequest, CompletionRequest, GenerateRequest, ModelCard, ModelList,
)
from epdserve.gateway.stages import StageClient, StageError
from epdserve.logging_setup import set_request_context
from epdserve.metrics import GatewayMetrics
from epdserve.models.paths import resolve_model_path

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("epdserve.gateway")

T = TypeVar("T")

# How long an idle keep-alive connection stays open, in seconds: longer than any client pool's own idle expiry
# (httpx and the openai SDK 5 s, aiohttp 15 s). A client starts that clock once it has closed a response, later
# than the server did, so at uvicorn's default (5 s, httpx's too) a loaded httpx pool reused connections the gateway
# was closing at that moment, and those requests died unanswered (ReadError; a POST is not retried).
KEEP_ALIVE_S = 120


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class Gateway:
    """Everything one gateway app holds: config, stage connections and (once started) the chat service.

    Lives in ``app.state.gateway``. ``ready`` is True once :meth:`start` has finished.
    """

    def __init__(self, config: GatewayConfig, stages: StageClient | None = None,
                 startup_timeout_s: float = 300.0):
        self.config = config
        self.model_path = resolve_model_path(config.model_path)
        self.model_name = config.served_model_name or self.model_path
        self.stages = stages if stages is not None else StageClient(config)
        self.startup_timeout_s = startup_timeout_s
        self.chat: ChatService | None = None
        self.startup_error: BaseException | None = None
        self._http: httpx.AsyncClient | None = None
        self.metrics = GatewayMetrics()
        self.requests = RequestIds(self.metrics)
        self.admission = Admission(config.max_inflight_requests, config.max_queued_requests, config.queue_timeout_s)

    @property
    def ready(self) -> bool:
        return self.chat is not None and self.stages.ready

    async def start(self) -> None:
        """Load the processor and handshake with the stages; failures are logged and kept in ``startup_error``."""
        try:
            builder = await asyncio.to_thread(PromptBuilder.from_pretrained, self.model_path)
            await self.stages.start(self.startup_timeout_s)
            for info in (self.stages.prefill_info, self.stages.decode_info):
                if info.model_path and info.model_path != self.model_path:
                    logger.warning("the %s server serves %s, the gateway tokenizes with %s", info.role,
                                   info.model_path, self.model_path)
            if self.config.allow_remote_images:
                self._http = httpx.AsyncClient(follow_redirects=True)
            media = MediaPolicy(max_bytes=self.config.max_image_bytes, allow_remote=self.config.allow_remote_images,
                                local_root=self.config.allowed_local_media_path)
            self.chat = ChatService(self.stages, builder, self.model_name, media, self.config.max_tokens_default,
                                    self._http, self.metrics)
        except Exception as e:
            self.startup_error = e
            logger.error("gateway startup failed: %s", e)

    async def close(self) -> None:
        if self.chat is not None:
            self.chat.close()
        await self.stages.close()
        if self._http is not None:
            await self._http.aclose()


def create_app(config: GatewayConfig, stages: StageClient | None = None, *,
               startup_timeout_s: float = 300.0) -> FastAPI:
    """Build the gateway's FastAPI app.

    The stage handshake runs in the background from the app's lifespan, so the server answers ``/health`` (503)
    while the stages load.

    Args:
        config: the gateway config.
        stages: stage connections to use instead of ``StageClient(config)`` (tests inject fakes). The app starts
            and closes them.
        startup_timeout_s: how long to wait for prefill/decode/encoder to answer, in seconds.

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
    """
    gw = Gateway(config, stages, startup_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        startup = asyncio.create_task(gw.start())
        try:
            yield
        finally:
            startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await gw.close()

    app = FastAPI(title="epdserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body().model_dump(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return await _api_error(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return await _api_error(request, APIError(400, str(e.errors())))

    async def authorize(request: Request) -> None:
        if not config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    @app.get("/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/health")
    async def health(details: bool = False, fresh: bool = False) -> Response:
        why = gw.stages.not_ready() if gw.chat is not None else None
        if gw.ready and why is None and not details:
            return Response(status_code=200)
        if not gw.ready:
            why = f"not ready: {gw.startup_error}" if gw.startup_error else "not ready: waiting for the stages"
        status = 200 if why is None else 503
        if not details:
            return JSONResponse(APIError(503, why).body().model_dump(), status_code=503)
        body = {"status": "ok" if why is None else "unavailable", "reason": why,
                "gateway": {"inflight": gw.admission.inflight, "queued": gw.admission.queued,
                            "at_stages": gw.stages.num_inflight if gw.ready else 0},
                "stages": await gw.stages.health(fresh) if gw.stages.liveness else {}}
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> JSONResponse:
        card = ModelCard(id=gw.model_name, root=gw.model_path,
                         max_model_len=gw.stages.context_length if gw.ready else None)
        return JSONResponse(ModelList(data=[card]).model_dump())

    add_observability_routes(app, gw, authorize)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, _chat)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        """OpenAI's legacy completions: a prompt (text or token ids) in, no chat template."""
        return await _handle(request, _completion)

    @app.post("/generate", dependencies=[Depends(authorize)])
    async def generate(request: Request) -> Response:
        """SGLang's native API: text or token ids in, no chat template (see ``epdserve.gateway.generate``)."""
        return await _handle(request, _generate)

    async def _handle(request: Request, handler) -> Response:
        rid = request.state.rid = gw.requests.open(request.headers.get("x-request-id"))
        set_request_context(rid)  # this task serves one request: its log lines all name it
        streaming = False  # a stream's response releases the id itself, once it is over
        try:
            response = await handler(request, rid)
            streaming = isinstance(response, ClosingStreamingResponse)
            return response
        except APIError as e:
            logger.info("rid=%s -> %d: %s", rid, e.status, e.message)
            gw.metrics.on_failed(f"http_{e.status}")
            raise
        except ClientGone:
            logger.info("rid=%s client disconnected", rid)
            gw.metrics.on_failed("client_disconnected", "abort")
            return Response(status_code=499)
        except Exception as e:  # keep serving: one bad request must not take the gateway down
            logger.exception("rid=%s internal error", rid)
            gw.metrics.on_failed("internal")
            raise APIError(500, f"internal error: {e}") from None
        finally:
            if not streaming:
                gw.requests.close(rid)

    async def _chat(request: Request, rid: str) -> Response:
        req = parse_request(await request.body(), ChatCompletionRequest, gw.model_name)

        async def complete(prepared) -> dict:
            return (await gw.chat.complete(prepared)).model_dump()

        return await _admitted(request, lambda deadline: gw.chat.prepare(rid, req, deadline), req.stream,
                               lambda prepared: gw.chat.stream(prepared), complete)

    async def _generate(request: Request, rid: str) -> Response:
        req = parse_request(await request.body(), GenerateRequest, None)
        return await _admitted(request, lambda deadline: gw.chat.prepare_ids(rid, req, deadline), req.stream,
                               lambda prepared: generate_events(gw.chat, prepared),
                               lambda prepared: generate_json(gw.chat, prepared))

    async def _completion(request: Request, rid: str) -> Response:
        req = parse_request(await request.body(), CompletionRequest, gw.model_name)
        return await _admitted(request, lambda deadline: gw.chat.prepare_ids(rid, req.as_generate(), deadline),
                               req.stream, lambda prepared: completion_events(gw.chat, prepared, req),
                               lambda prepared: completion_json(gw.chat, prepared, req))

    async def _admitted(request: Request, prepare, stream: bool, events, complete) -> Response:
        """Serve one validated request: wait for an admission slot, ``prepare(deadline)`` the stage requests,
        then answer with SSE from ``events(prepared)`` or JSON from ``await complete(prepared)``."""
        if not gw.ready:
            raise APIError(503, "the server is starting: the stages are not ready yet")
        if (why := gw.stages.unavailable()) is not None:
            raise APIError.from_stage(StageError(why, 503))
        try:
            await until_disconnect(request, gw.admission.acquire())
        except Overloaded as e:
            raise APIError(e.status, e.message, headers={"Retry-After": str(e.retry_after_s)}) from None
        streaming = False
        prepared = None
        try:
            timeout = config.request_timeout_s
            deadline = time.monotonic() + timeout if timeout > 0 else None
            prepared = await until_disconnect(request, prepare(deadline))
            if stream:
                # Starlette cancels the body iterator when the client disconnects; the iterator aborts then.
                streaming = True
                return ClosingStreamingResponse(events(prepared), media_type="text/event-stream",
                                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                                on_close=lambda: _stream_closed(prepared))
            return JSONResponse(await until_disconnect(request, complete(prepared)))
        finally:
            if not streaming:
                gw.admission.release()
                if prepared is not None:  # an image request is dispatched before its answer begins
                    gw.stages.release(prepared.rid)

    def _stream_closed(prepared) -> None:
        gw.admission.release()
        gw.stages.release(prepared.rid)
        gw.requests.close(prepared.rid)
        prepared.trace.fail("client_disconnected", "abort")  # a no-op when the stream got to its end

    return app


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (which aborts the request) and raise ClientGone."""
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


def main(config: GatewayConfig) -> None:
    """Serve the gateway until interrupted (uvicorn, log level warning).

    Logs one line, ``gateway ready on http://HOST:PORT (model=NAME)``, once the HTTP server listens and the stages
    answered. Exits with status 1 if the stages cannot be reached in time.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    app = create_app(config)
    server = uvicorn.Server(server_config(app, config.host, config.port))
    if not asyncio.run(_serve(server, app.state.gateway)):
        sys.exit(1)


async def _serve(server, gw: Gateway) -> bool:
    """Run ``server`` and log the ready line once both it listens and ``gw`` is ready. False on startup failure."""
    serving = asyncio.create_task(server.serve())
    while not serving.done():
        if server.started and gw.ready:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else gw.config.port
            logger.info("gateway ready on http://%s:%d (model=%s)", gw.config.host, port, gw.model_name)
            break
        if gw.startup_error is not None:
            server.should_exit = True
            break
        await asyncio.sleep(0.05)
    await serving
    return gw.startup_error is None
