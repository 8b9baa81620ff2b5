"""The HTTP front of a prefill or decode server, for a PD router (smg, SGLang's router) in front of many of them.

SGLang's PD protocol: the router sends the client's OpenAI request body, plus ``bootstrap_host``,
``bootstrap_port`` (the prefill server's bootstrap port) and ``bootstrap_room`` (random, new on every retry), to the
same route of one prefill and one decode server at once, waits for the prefill leg's status and returns the
decode leg's response. Each front builds the prompt on its own with the gateway's code (``ChatService.prepare``:
chat template, image slots, sampling parameters), so both agree on the token ids by construction; a digest of the
ids travels with the prefill request into the KV transfer and decode fails the request on a mismatch.

- Prefill front: encodes images on ``--encoder-urls`` (content-hash routing, failover: ``EncoderPool``) with this
  server's TP-rank embedding endpoints as targets, sends ``PrefillRequest(reply=True)`` and answers once prefill is
  done, with the first token only (``finish_reason="length"``).
- Decode front: counts image tokens from the image sizes (the processor's resize rule, no vision tower), sends
  ``DecodeRequest`` with the client's bootstrap fields and answers like the gateway (JSON or SSE).

The front runs as a child process of the server (:func:`spawn_front`), as SGLang's tokenizer manager does, so
tokenization never shares a GIL with the scheduler loop; it talks to the loop over the loop's ZMQ request socket
exactly as a gateway does. It dies with its parent (``PR_SET_PDEATHSIG``), so a killed server refuses
connections at once and the router moves on.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /generate`` (SGLang's native API);
the last two take text or token ids without a chat template (``epdserve.gateway.generate``). ``GET /health``
(readiness: 200 once the processor is loaded, the scheduler answered and, on a prefill front with
``--encoder-urls``, an encoder serves; else 503 with the reason), ``GET /health/live`` (200 while the process
answers), ``/v1/models``, ``/model_info``, ``/server_info``,
``/loads`` (and SGLang's older names ``/get_model_info``, ``/get_server_info``, and ``/v1/loads``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from epdserve.gateway.app import (
    ClientGone, describe_validation_error, first_error_param, parse_request, server_config, until_disconnect,
)
from epdserve.gateway.chat import APIError, ChatService, PreparedChat
from epdserve.gateway.generate import completion_events, completion_json, generate_events, generate_json
from epdserve.gateway.media import MediaPolicy
from epdserve.gateway.prompt import EncodedImage, PromptBuilder
from epdserve.gateway.protocol import (
    ChatCompletionChunk, ChatCompletionRequest, ChunkChoice, CompletionRequest, Delta, GenerateRequest, ModelCard,
    ModelList,
)
from epdserve.gateway.stages import OutputRoute, StageError
from epdserve.wire.messages import (
    AbortRequest, Load, LoadRequest, ServerInfo, ServerInfoRequest, TokenOutput, TokenOutputBatch, WireError,
    decode, encode, input_ids_digest,
)

logger = logging.getLogger("epdserve.front")

_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # the gateway's default --max-image-bytes


class BootstrapFields(BaseModel):
    """The three fields a PD router adds to the client's body (SGLang's names). ``bootstrap_port`` is null when
    the router knows no bootstrap port for the prefill server."""

    model_config = ConfigDict(extra="ignore")

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class SchedulerClient:
    """The front's ZMQ DEALER to its own scheduler loop (the socket the epdserve gateway also uses).

    A reader task routes ``TokenOutput``s to the queue of their request id and ``Load`` replies to the oldest
    pending :meth:`load`. All methods run on the event loop that called :meth:`start`.
    """

    def __init__(self, endpoint: str, role: str):
        self.endpoint = endpoint
        self.role = role
        self.info: ServerInfo | None = None
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._routes: dict[str, OutputRoute] = {}
        self._loads: list[asyncio.Future[Load]] = []
        self._reader: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()

    async def start(self) -> ServerInfo:
        """Ask for ``ServerInfo`` every 2 s until the scheduler answers (it may still be loading the model).

        Raises:
            StageError: the socket belongs to a server of another role.
        """
        while True:
            await self._sock.send_multipart(encode(ServerInfoRequest()))
            if await self._sock.poll(2000, zmq.POLLIN):
                try:
                    msg = decode(await self._sock.recv_multipart())
                except WireError as e:
                    logger.warning("bad message from the %s scheduler: %s", self.role, e)
                    continue
                if isinstance(msg, ServerInfo):
                    if msg.role != self.role:
                        raise StageError(f"{self.endpoint} is a {msg.role!r} server, expected {self.role!r}")
                    self.info = msg
                    self._reader = asyncio.get_running_loop().create_task(self._read_loop())
                    return msg

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = decode(frames)
            except WireError as e:
                logger.warning("dropped a malformed message from the scheduler: %s", e)
                continue
            outs = msg.outputs if isinstance(msg, TokenOutputBatch) else [msg] if isinstance(msg, TokenOutput) else []
            for out in outs:
                if (route := self._routes.get(out.rid)) is not None:
                    route.put(out)
            if isinstance(msg, Load):
                while self._loads:
                    fut = self._loads.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
                        break

    async def load(self, timeout_s: float = 5.0) -> Load:
        """The scheduler's current :class:`Load`.

        Raises:
            TimeoutError: no answer within ``timeout_s`` (the loop is busy or gone).
        """
        fut = asyncio.get_running_loop().create_future()
        self._loads.append(fut)
        await self._sock.send_multipart(encode(LoadRequest()))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            if fut in self._loads:
                self._loads.remove(fut)

    async def run(self, msg: Any) -> AsyncIterator[TokenOutput]:
        """Send ``msg`` (a request with ``rid``) and yield its outputs until one has a ``finish_reason``.

        Stopping early (client gone, stop string, cancellation) sends an ``AbortRequest``; use it under
        ``contextlib.aclosing``.
        """
        rid = msg.rid
        route = OutputRoute()  # outputs that queue up while the client is served go out merged
        self._routes[rid] = route
        finished = False
        try:
            await self._sock.send_multipart(encode(msg))
            while True:
                out = await route.take(None)
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._routes.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        """Tell the scheduler to drop ``rid`` (synchronous: it runs in ``finally`` blocks of cancelled tasks)."""
        logger.debug("rid=%s abort", rid)
        task = asyncio.ensure_future(self._sock.send_multipart(encode(AbortRequest(rid))))  # a zmq Future
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def close(self) -> None:
        if self._sends:
            await asyncio.wait(list(self._sends), timeout=1.0)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._ctx.destroy(linger=0)


class FrontStages(Protocol):
    """What a role gives :class:`ChatService` in place of the gateway's ``StageClient`` (see
    ``epdserve.prefill.http_front`` and ``epdserve.decode.http_front``). ``deadline`` is accepted for
    ``ChatService``'s sake and not used: behind a PD router the router bounds each request."""

    role: str
    scheduler: SchedulerClient

    @property
    def ready(self) -> bool: ...

    @property
    def context_length(self) -> int: ...

    @property
    def prefill_info(self) -> ServerInfo: ...

    async def start(self, builder: PromptBuilder) -> None: ...

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None) -> list[EncodedImage]: ...

    def dispatch(self, prefill_req, decode_req) -> None:
        """A front starts its leg in :meth:`generate` (the router sent the request once its inputs were ready):
        nothing to do ahead of it."""

    def generate(self, prefill_req, decode_req, deadline: float | None = None) -> AsyncIterator[TokenOutput]: ...

    def abort(self, rid: str) -> None: ...

    async def close(self) -> None: ...


def check_bootstrap(role: str, fields: BootstrapFields) -> None:
    """Refuse a request a ``role`` front cannot serve with these bootstrap fields.

    Raises:
        APIError: 400 when the room is missing (the request did not come from a PD router), or, for decode, the
            prefill server's bootstrap host or port.
    """
    if fields.bootstrap_room is None:
        raise APIError(400, "this is a prefill/decode server for a PD router (smg): the request needs "
                            "bootstrap_host, bootstrap_port and bootstrap_room", param="bootstrap_room")
    if role == "decode" and not (fields.bootstrap_host and fields.bootstrap_port):
        raise APIError(400, "bootstrap_host or bootstrap_port is missing: register the prefill server with its "
                            "bootstrap port (smg: --prefill URL BOOTSTRAP_PORT)", param="bootstrap_port")


def bind_room(chat: PreparedChat, fields: BootstrapFields) -> PreparedChat:
    """Put the router's bootstrap fields (checked by :func:`check_bootstrap`) and the prompt's digest into both
    stage requests of ``chat``."""
    digest = input_ids_digest(chat.prompt.input_ids)
    chat.prefill = replace(chat.prefill, bootstrap_room=fields.bootstrap_room, reply=True, input_digest=digest)
    chat.decode = replace(chat.decode, bootstrap_room=fields.bootstrap_room, input_digest=digest,
                          bootstrap_host=fields.bootstrap_host or "", bootstrap_port=fields.bootstrap_port or 0)
    return chat


def room_rid(room: int | None) -> str:
    """The request id of a room's legs: the same on prefill and decode, so their log lines match."""
    return f"chatcmpl-{room:016x}" if room is not None else f"chatcmpl-{os.urandom(8).hex()}"


@dataclass
class Front:
    """Everything one front app holds; ``ready`` once the processor is loaded and the scheduler answered."""

    role: str
    model_path: str
    model_name: str
    stages: FrontStages
    chat: ChatService | None = None
    startup_error: BaseException | None = None
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.chat is not None and self.stages.ready

    def not_ready(self) -> str | None:
        """Why this front cannot serve every kind of request it accepts now (``GET /health``'s 503), or None:
        still loading, or (a prefill front with ``--encoder-urls``) no encoder serving."""
        if not self.ready:
            return f"not ready: {self.startup_error}" if self.startup_error else "not ready: loading"
        not_serving = getattr(getattr(self.stages, "encoder", None), "not_serving", None)
        return not_serving() if not_serving is not None else None

    async def start(self) -> None:
        try:
            builder = await asyncio.to_thread(PromptBuilder.from_pretrained, self.model_path)
            await self.stages.start(builder)
            media = MediaPolicy(max_bytes=_MAX_IMAGE_BYTES)
            self.chat = ChatService(self.stages, builder, self.model_name, media)
            logger.info("%s front ready (model=%s)", self.role, self.model_name)
        except Exception as e:
            self.startup_error = e
            logger.exception("%s front startup failed", self.role)


def create_front_app(front: Front) -> FastAPI:
    """The FastAPI app of a prefill or decode front (see the module docstring for the routes)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        startup = asyncio.create_task(front.start())
        try:
            yield
        finally:
            startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            if front.chat is not None:
                front.chat.close()
            await front.stages.close()

    app = FastAPI(title=f"epdserve {front.role}", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.front = front

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body().model_dump(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return await _api_error(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return await _api_error(request, APIError(400, str(e.errors())))

    @app.get("/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        if (why := front.not_ready()) is None:
            return Response(status_code=200)
        return JSONResponse(APIError(503, why).body().model_dump(), status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = front.stages.scheduler.info
        card = ModelCard(id=front.model_name, root=front.model_path,
                         max_model_len=info.context_length if info else None)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse({"model_path": front.model_path, "tokenizer_path": front.model_path,
                             "served_model_name": front.model_name, "is_generation": True,
                             "has_image_understanding": True})

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        info = front.stages.scheduler.info
        body = {"role": front.role, "disaggregation_mode": front.role, "model_path": front.model_path,
                "served_model_name": front.model_name, **front.extra_info}
        if info is not None:
            body |= {"context_length": info.context_length, "page_size": info.page_size,
                     "num_pages": info.num_pages}
        return JSONResponse(body)

    @app.get("/loads")
    @app.get("/v1/loads")
    async def loads() -> JSONResponse:
        if not front.stages.ready:
            raise APIError(503, "not ready")
        try:
            load = await front.stages.scheduler.load()
        except TimeoutError:
            raise APIError(503, "the scheduler did not answer") from None
        return JSONResponse(loads_body(load, front.stages.scheduler.info.page_size))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, _chat, ChatCompletionRequest)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _handle(request, _generate, GenerateRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, _completion, CompletionRequest)

    async def _handle(request: Request, handler, schema: type[BaseModel]) -> Response:
        body = await request.body()
        try:
            fields = BootstrapFields.model_validate_json(body)
        except ValidationError as e:
            raise APIError(400, describe_validation_error(e), param=first_error_param(e)) from None
        rid = room_rid(fields.bootstrap_room)
        try:
            req = parse_request(body, schema, front.model_name if "model" in schema.model_fields else None)
            check_bootstrap(front.role, fields)
            if not front.ready:
                raise APIError(503, "the server is starting")
            return await handler(request, rid, req, fields)
        except APIError as e:
            logger.info("rid=%s -> %d: %s", rid, e.status, e.message)
            raise
        except ClientGone:
            logger.info("rid=%s client disconnected", rid)
            return Response(status_code=499)
        except Exception as e:  # one bad request must not take the front down
            logger.exception("rid=%s internal error", rid)
            raise APIError(500, f"internal error: {e}") from None

    async def _chat(request: Request, rid: str, req: ChatCompletionRequest, fields: BootstrapFields) -> Response:
        chat = front.chat

        async def answer(prepared: PreparedChat) -> dict:
            return (await chat.complete(prepared)).model_dump()

        def first_chunk(body: dict) -> str:
            choice = body["choices"][0]
            return ChatCompletionChunk(id=rid, created=body["created"], model=front.model_name, choices=[ChunkChoice(
                delta=Delta(role="assistant", content=choice["message"]["content"]),
                finish_reason=choice["finish_reason"])]).model_dump_json()

        return await _leg(request, chat.prepare(rid, req), fields, req.stream, chat.stream, answer, first_chunk)

    async def _generate(request: Request, rid: str, req: GenerateRequest, fields: BootstrapFields) -> Response:
        chat = front.chat
        return await _leg(request, chat.prepare_ids(rid, req), fields, req.stream,
                          lambda p: generate_events(chat, p), lambda p: generate_json(chat, p), json.dumps)

    async def _completion(request: Request, rid: str, req: CompletionRequest, fields: BootstrapFields) -> Response:
        chat = front.chat
        return await _leg(request, chat.prepare_ids(rid, req.as_generate()), fields, req.stream,
                          lambda p: completion_events(chat, p, req), lambda p: completion_json(chat, p, req),
                          json.dumps)

    async def _leg(request: Request, prepare: Awaitable[PreparedChat], fields: BootstrapFields, stream: bool,
                   events, answer, prefill_event) -> Response:
        """Serve this front's leg of one request. The decode leg streams ``events(prepared)`` (its HTTP status
        waits for the first token) or answers ``await answer(prepared)`` in full. The router only needs the
        prefill leg's status: it answers once prefill is done, with the first token (as one
        ``prefill_event(body)`` event when streamed)."""
        prepared = bind_room(await until_disconnect(request, prepare), fields)
        if stream and front.role == "decode":
            await _prime(request, prepared)
            return StreamingResponse(events(prepared), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        body = await until_disconnect(request, answer(prepared))
        if stream:
            return Response(f"data: {prefill_event(body)}\n\ndata: [DONE]\n\n", media_type="text/event-stream")
        return JSONResponse(body)

    async def _prime(request: Request, prepared: PreparedChat) -> None:
        # A stream's HTTP status waits for the first token: a failure before it stays retryable by the router.
        first = await until_disconnect(request, front.stages.first_output(prepared.decode))
        if first.finish_reason == "error":
            front.stages.discard(prepared.rid)
            raise APIError(500, first.error or "generation failed")

    return app


def loads_body(load: Load, page_size: int) -> dict[str, Any]:
    """SGLang's ``/v1/loads`` shape (one DP rank) with epdserve's own counts added: KV pages (used, cached,
    total), bootstrap rooms and held embeddings. ``token_usage`` leaves out evictable radix-cache pages."""
    busy = load.kv_pages_used - load.kv_pages_cached
    rank = {
        "dp_rank": 0,
        "num_running_reqs": load.num_running_reqs,
        "num_waiting_reqs": load.num_waiting_reqs,
        "num_total_reqs": load.num_running_reqs + load.num_waiting_reqs,
        "num_used_tokens": busy * page_size,
        "max_total_num_tokens": load.kv_pages_total * page_size,
        "token_usage": busy / load.kv_pages_total if load.kv_pages_total else 0.0,
        **dataclasses.asdict(load),
    }
    return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [rank], "aggregate": dict(rank)}


# ---- the child process (started by epdserve.gateway.front_process.spawn_front) ---------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux), and exit now if it already has.

    A front whose scheduler is gone would accept requests it can never finish; dead, its port refuses them and
    the router retries elsewhere at once.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        logger.warning("cannot tie the front's life to its server's (no prctl)")
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """``python -m epdserve.gateway.pd_front ROLE CONFIG_JSON --parent-pid PID``: serve one front until SIGTERM."""
    parser = argparse.ArgumentParser(prog="epdserve.gateway.pd_front")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("config", help="the server's config as JSON")
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    from epdserve.entry.cli import setup_logging
    from epdserve.config import DecodeConfig, PrefillConfig

    setup_logging(args.log_level)
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    cls = PrefillConfig if args.role == "prefill" else DecodeConfig
    config = cls(**json.loads(args.config))
    if args.role == "prefill":
        from epdserve.prefill.http_front import PrefillFrontStages as stages_cls
    else:
        from epdserve.decode.http_front import DecodeFrontStages as stages_cls
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    stages = stages_cls(config, SchedulerClient(f"tcp://{local}:{config.zmq_port}", args.role))
    front = Front(args.role, config.model_path, config.served_model_name or config.model_path, stages,
                  extra_info=stages.server_info_fields())
    import uvicorn

    server = uvicorn.Server(server_config(create_front_app(front), config.host, config.port, graceful_shutdown_s=2))
    logger.info("%s front listening on http://%s:%d", args.role, config.host, config.port)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
