"""SGLang's PD protocol at a prefill or decode HTTP front, for a PD router (smg, SGLang's router) in front of many
servers.

The router sends the client's OpenAI request body, plus ``bootstrap_host``, ``bootstrap_port`` (the prefill
server's bootstrap port) and ``bootstrap_room`` (random, new on every retry), to the same route of one prefill and
one decode server at once, waits for the prefill leg's status and returns the decode leg's response. Each front
builds the prompt on its own with the same code (``ChatService.prepare``: chat template, image slots, sampling
parameters), so both agree on the token ids by construction; a digest of the ids travels with the prefill request
into the KV transfer and decode fails the request on a mismatch.

- Prefill leg: answers once prefill is done, with the first token only (``finish_reason="length"``).
- Decode leg: answers like the gateway (JSON or SSE); a stream's HTTP status waits for the first token.

The front runs as a child process of its server (``epdserve.frontend.process.spawn_front``; its app and ``main``:
:mod:`epdserve.entry.front`), as SGLang's tokenizer manager does, so tokenization never shares a GIL with the
scheduler loop; it talks to the loop over the loop's ZMQ request socket exactly as a gateway does
(:class:`SchedulerStages`). It dies with its parent (``PR_SET_PDEATHSIG``), so a killed server refuses connections
at once and the router moves on.

Routes: the OpenAI and native routers (``/v1/chat/completions``, ``/v1/completions``, ``/generate``,
``/v1/models``) behind :class:`LegPath`, and :func:`front_router`'s: ``GET /health`` (readiness: 200 once the
processor is loaded, the scheduler answered and, on a prefill front with ``--encoder-urls``, an encoder serves;
else 503 with the reason), ``GET /health/live``, ``/model_info``, ``/server_info``, ``/loads`` (and SGLang's older
names ``/get_model_info``, ``/get_server_info``, and ``/v1/loads``).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.errors import APIError
from epdserve.frontend.httputil import describe_validation_error, first_error_param, until_disconnect
from epdserve.frontend.lifetime import RequestLifetime
from epdserve.frontend.media import MediaPolicy
from epdserve.frontend.prompt import EncodedImage, PromptBuilder, VideoInput
from epdserve.frontend.scheduler_client import SchedulerClient
from epdserve.frontend.serving import Call, RequestPath
from epdserve.wire.messages import DecodeRequest, Load, PrefillRequest, TokenOutput, input_ids_digest

logger = logging.getLogger("epdserve.front")

_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # the gateway's default --max-image-bytes


class BootstrapFields(BaseModel):
    """The three fields a PD router adds to the client's body (SGLang's names). ``bootstrap_port`` is null when
    the router knows no bootstrap port for the prefill server."""

    model_config = ConfigDict(extra="ignore")

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _first_of_lists(cls, data: Any) -> Any:
        """For ``n > 1`` a router sends each field as a list, one per sample (SGLang prefills every sample on its
        own); here the ``n`` choices share one prefill (one room), so both legs take the first entry."""
        if isinstance(data, dict):
            return {k: v[0] if k.startswith("bootstrap_") and isinstance(v, list) and v else v
                    for k, v in data.items()}
        return data


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


class SchedulerStages(abc.ABC):
    """What the prefill and decode fronts' :class:`~epdserve.frontend.stages.Stages` share: one scheduler, this
    server's own, over :class:`SchedulerClient`; a role's subclass sends its own leg's request (:meth:`leg`) and
    says whether and how it encodes (:attr:`encodes`, :meth:`encode`) and where prefill's bootstrap server is.
    ``deadline`` is accepted and not used: behind a PD router the router bounds each request.

    Args:
        config: the server's config.
        scheduler: the client of this server's scheduler socket.
    """

    role: str
    encodes: bool
    sends_before_encoded = False  # the router's bootstrap fields are bound after preparing

    def __init__(self, config: Any, scheduler: SchedulerClient):
        self.config = config
        self.scheduler = scheduler

    @property
    def ready(self) -> bool:
        """True once the scheduler answered the handshake."""
        return self.scheduler.info is not None

    @property
    def context_length(self) -> int:
        """The scheduler's context length in tokens (once ready)."""
        return self.scheduler.info.context_length

    def not_ready(self) -> str | None:
        """None: a ready scheduler serves every request this front accepts (a role may say otherwise)."""
        return None

    def server_info_fields(self) -> dict[str, Any]:
        """The role's extra ``/get_server_info`` fields."""
        return {}

    async def start(self) -> None:
        """Ask the scheduler for its ``ServerInfo`` until it answers (it may still be loading the model)."""
        self.scheduler.info = await self.scheduler.handshake()
        self.scheduler.start_reader()

    @property
    @abc.abstractmethod
    def bootstrap(self) -> tuple[str, int] | None:
        """See ``Stages.bootstrap``."""

    @abc.abstractmethod
    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None,
                     videos: Sequence[VideoInput] = ()) -> list[EncodedImage]:
        """See ``Stages.encode``."""

    @abc.abstractmethod
    def leg(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> Any:
        """The message this role's scheduler takes for the request."""

    def send(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> None:
        """Send this role's leg of the request to the scheduler.

        Raises:
            StageError: never in practice: the socket queues until the scheduler connects.
        """
        self.scheduler.open(prefill_req.rid)
        self.scheduler.send(self.leg(prefill_req, decode_req))

    async def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                       deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """The leg's outputs until one has a ``finish_reason`` (the prefill leg: one, the first token or an
        error), sending it first unless :meth:`send` did."""
        if prefill_req.rid not in self.scheduler.routes:
            self.send(prefill_req, decode_req)
        async for out in self.scheduler.outputs(prefill_req.rid):
            yield out

    def release(self, rid: str) -> None:
        """Forget ``rid``; abort it at the scheduler unless it finished (or was never sent)."""
        if self.scheduler.drop(rid):
            self.abort(rid)

    def abort(self, rid: str) -> None:
        """Tell the scheduler to drop ``rid``."""
        logger.debug("rid=%s abort", rid)
        self.scheduler.abort(rid)

    def abort_choice(self, rid: str, index: int) -> None:
        """Tell the scheduler to stop choice ``index``'s fork (a prefill scheduler ignores it)."""
        self.scheduler.abort(rid, index)

    async def close(self) -> None:
        """Close the scheduler connection."""
        await self.scheduler.close()


@dataclasses.dataclass
class Front:
    """Everything one front app holds; ``ready`` once the processor is loaded and the scheduler answered."""

    role: str
    model_path: str
    model_name: str
    stages: SchedulerStages
    chat: ChatService | None = None
    startup_error: BaseException | None = None
    # Other services of this process on the same loop (the SGLang gRPC server of --grpc-port): started by
    # run_front before the model loads, stopped first by close().
    services: list = dataclasses.field(default_factory=list)

    @property
    def ready(self) -> bool:
        """True once the processor is loaded and the scheduler answered."""
        return self.chat is not None and self.stages.ready

    def max_model_len(self) -> int | None:
        """The scheduler's context length once it answered, else None."""
        return self.stages.context_length if self.stages.ready else None

    def not_ready(self) -> str | None:
        """Why this front cannot serve every kind of request it accepts now (``GET /health``'s 503), or None:
        still loading, or (a prefill front with ``--encoder-urls``) no encoder serving."""
        if not self.ready:
            return f"not ready: {self.startup_error}" if self.startup_error else "not ready: loading"
        return self.stages.not_ready()

    async def start(self) -> None:
        """Load the processor and handshake with the scheduler; a failure is logged and kept."""
        try:
            builder = await asyncio.to_thread(PromptBuilder.from_pretrained, self.model_path)
            await self.stages.start()
            media = MediaPolicy(max_bytes=_MAX_IMAGE_BYTES)
            self.chat = ChatService(self.stages, builder, self.model_name, media)
            logger.info("%s front ready (model=%s)", self.role, self.model_name)
        except Exception as e:
            self.startup_error = e
            logger.exception("%s front startup failed", self.role)

    async def close(self) -> None:
        """Stop the other services, the tokenizer thread, and close the stages."""
        for service in self.services:
            await service.stop()
        if self.chat is not None:
            self.chat.close()
        await self.stages.close()


class LegPath(RequestPath):
    """A PD front's request path: the request id comes from the router's room, there is no admission control or
    deadline here (the router bounds each request), and the answer is this front's leg."""

    server: Front

    async def open(self, request: Request) -> RequestLifetime:
        """The request id from the router's room.

        Raises:
            APIError: 400 for bootstrap fields of the wrong type.
        """
        try:
            fields = BootstrapFields.model_validate_json(await request.body())
        except ValidationError as e:
            raise APIError(400, describe_validation_error(e), param=first_error_param(e)) from None
        request.state.bootstrap = fields
        return RequestLifetime(room_rid(fields.bootstrap_room), self.server.stages)

    async def answer(self, request: Request, lifetime: RequestLifetime, make_call: Callable[[], Call]) -> Response:
        """Serve this front's leg. The decode leg streams ``call.events`` (its HTTP status waits for the first
        token) or answers ``call.complete`` in full. The router only needs the prefill leg's status: it answers
        once prefill is done, with the first token (as one ``call.as_event`` event when streamed)."""
        front, fields = self.server, request.state.bootstrap
        check_bootstrap(front.role, fields)
        if not front.ready:
            raise APIError(503, "the server is starting")
        call = make_call()
        lifetime.staging()
        prepared = lifetime.prepared = bind_room(await until_disconnect(request, call.prepare(None)), fields)
        if call.stream and front.role == "decode":
            # A stream's HTTP status waits for the first token: a failure before it stays retryable by the router.
            first = await until_disconnect(request, front.chat.prime(prepared))
            if first.finish_reason == "error":
                raise APIError(500, first.error or "generation failed")
            return lifetime.stream(call.events(prepared))
        body = await until_disconnect(request, call.complete(prepared))
        if call.stream:
            return Response(f"data: {call.as_event(body)}\n\ndata: [DONE]\n\n", media_type="text/event-stream")
        return JSONResponse(body)


def front_router(front: Front) -> APIRouter:
    """``/health``, ``/model_info``, ``/server_info``, ``/loads`` (and SGLang's older names ``/get_model_info``,
    ``/get_server_info``, ``/v1/loads``) of a PD front."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if (why := front.not_ready()) is None:
            return Response(status_code=200)
        return JSONResponse(APIError(503, why).body().model_dump(), status_code=503)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse({"model_path": front.model_path, "tokenizer_path": front.model_path,
                             "served_model_name": front.model_name, "is_generation": True,
                             "has_image_understanding": True})

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> JSONResponse:
        info = front.stages.scheduler.info
        body = {"role": front.role, "disaggregation_mode": front.role, "model_path": front.model_path,
                "served_model_name": front.model_name, **front.stages.server_info_fields()}
        if info is not None:
            body |= {"context_length": info.context_length, "page_size": info.page_size,
                     "num_pages": info.num_pages}
        return JSONResponse(body)

    @router.get("/loads")
    @router.get("/v1/loads")
    async def loads() -> JSONResponse:
        if not front.stages.ready:
            raise APIError(503, "not ready")
        try:
            load = await front.stages.scheduler.load()
        except TimeoutError:
            raise APIError(503, "the scheduler did not answer") from None
        return JSONResponse(loads_body(load, front.stages.scheduler.info.page_size))

    return router


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
