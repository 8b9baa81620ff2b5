"""The gateway's observability: request ids, ``GET /metrics``, ``GET /get_model_info``, ``GET /get_server_info``.

Request ids: a client's ``X-Request-Id`` header (sanitized: see :func:`epdserve.logging_setup.sanitize_request_id`)
becomes the request id, else ``chatcmpl-<uuid>``. It is the response's ``id``, is echoed in the response's
``X-Request-Id`` header, and travels to every stage (the encoder's ``request_id``, the ``rid`` of the ZMQ
messages), so one id finds a request's log lines in all four processes. An id already in flight at this gateway is
refused (400): the stages key their state by it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import epdserve
from epdserve.gateway.chat import APIError
from epdserve.logging_setup import sanitize_request_id
from epdserve.metrics import GatewayMetrics, exposition_registry

if TYPE_CHECKING:
    from epdserve.gateway.app import Gateway

REQUEST_ID_HEADER = "X-Request-Id"
_ENCODER_INFO_TIMEOUT_S = 2.0


class RequestIds:
    """The request ids in flight at one gateway (also its ``epdserve:num_running_reqs`` gauge)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._active: set[str] = set()
        self._metrics = metrics
        metrics.running.set_function(lambda: len(self._active))

    def open(self, header: str | None) -> str:
        """The id of a new request: ``header`` sanitized, or ``chatcmpl-<32 hex>`` when it is absent or empty.

        Raises:
            APIError: 400 when that id is in flight already.
        """
        rid = sanitize_request_id(header) or f"chatcmpl-{uuid.uuid4().hex}"
        if rid in self._active:
            self._metrics.on_failed("duplicate_request_id")
            raise APIError(400, f"{REQUEST_ID_HEADER} {rid!r} is in use by a request in flight",
                           param=REQUEST_ID_HEADER, code="duplicate_request_id")
        self._active.add(rid)
        return rid

    def close(self, rid: str) -> None:
        """``rid``'s response is over (sent, failed or abandoned)."""
        self._active.discard(rid)

    def __len__(self) -> int:
        return len(self._active)


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that calls ``on_close()`` once it is over, however it ended (sent, client gone,
    never started): the request's id and its in-flight slot are released exactly then."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class RequestIdHeader:
    """ASGI middleware: adds ``X-Request-Id: <rid>`` to a response whose handler set ``request.state.rid``
    (errors included, which FastAPI's exception handlers answer without the handler's headers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = scope.get("state", {}).get("rid")
                if rid:
                    message["headers"] = [*message.get("headers", []),
                                          (REQUEST_ID_HEADER.lower().encode(), rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_observability_routes(app: FastAPI, gw: Gateway, authorize: Callable) -> None:
    """Register ``/metrics`` (open, as Prometheus scrapes it), ``/get_model_info`` and ``/get_server_info``
    (behind ``authorize``: they show the flags) and the ``X-Request-Id`` middleware on ``app``."""
    app.add_middleware(RequestIdHeader)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(exposition_registry(gw.metrics.registry)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_model_info", dependencies=[Depends(authorize)])
    async def get_model_info() -> JSONResponse:
        if not gw.ready:
            raise APIError(503, "the server is starting: the stages are not ready yet")
        return JSONResponse(model_info(gw))

    @app.get("/get_server_info", dependencies=[Depends(authorize)])
    async def get_server_info() -> JSONResponse:
        return JSONResponse(await server_info(gw))


def model_info(gw: Gateway) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` fields plus the stages' geometry (the gateway must be ready).

    ``tp_size`` is the prefill server's TP ranks (one embedding endpoint each); ``kv_pool_tokens`` is each LM
    server's KV pool in tokens (pages x page size).
    """
    pre, dec = gw.stages.prefill_info, gw.stages.decode_info
    return {
        "model_path": gw.model_path,
        "tokenizer_path": gw.model_path,
        "served_model_name": gw.model_name,
        "is_generation": True,
        "has_image_understanding": True,
        "context_length": gw.stages.context_length,
        "tp_size": max(1, len(pre.embed_endpoints)),
        "page_size": {"prefill": pre.page_size, "decode": dec.page_size},
        "kv_pool_pages": {"prefill": pre.num_pages, "decode": dec.num_pages},
        "kv_pool_tokens": {"prefill": pre.num_pages * pre.page_size, "decode": dec.num_pages * dec.page_size},
    }


async def server_info(gw: Gateway) -> dict[str, Any]:
    """The gateway's flags (the API key masked), readiness, the stages' ``ServerInfo`` and every encoder's
    ``GetServerInfo`` (or the error asking it)."""
    flags = dataclasses.asdict(gw.config)
    if flags.get("api_key"):
        flags["api_key"] = "***"
    stages = gw.stages
    return {
        "version": epdserve.__version__,
        "ready": gw.ready,
        "startup_error": None if gw.startup_error is None else str(gw.startup_error),
        "flags": flags,
        "requests_in_flight": len(gw.requests),
        "prefill": None if stages.prefill_info is None else dataclasses.asdict(stages.prefill_info),
        "decode": None if stages.decode_info is None else dataclasses.asdict(stages.decode_info),
        "encoders": await _encoder_infos(stages.encoder),
    }


async def _encoder_infos(encoder: Any) -> list[dict[str, Any]]:
    clients = getattr(encoder, "clients", None) or ([encoder] if encoder is not None else [])

    async def one(client: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"addr": getattr(client, "addr", None)}
        ask = getattr(client, "server_info", None)
        if ask is None:
            return out
        try:
            out["info"] = await asyncio.wait_for(ask(), _ENCODER_INFO_TIMEOUT_S)
        except Exception as e:  # an encoder that is down must not fail the whole answer
            out["error"] = f"{type(e).__name__}: {e}"
        return out

    return list(await asyncio.gather(*(one(c) for c in clients)))
