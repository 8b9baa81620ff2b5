"""Observability every front end shares: request ids (:class:`RequestIds`, the ``X-Request-Id`` header) and the
``GET /metrics`` router.

Request ids: a client's ``X-Request-Id`` header (sanitized: see :func:`epdserve.logging_setup.sanitize_request_id`)
becomes the request id, else ``chatcmpl-<uuid>``. It is the response's ``id``, is echoed in the response's
``X-Request-Id`` header, and travels to every stage (the encoder's ``request_id``, the ``rid`` of the ZMQ
messages), so one id finds a request's log lines in all four processes. An id already in flight at this gateway is
refused (400): the stages key their state by it.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epdserve.frontend.errors import APIError
from epdserve.logging_setup import sanitize_request_id
from epdserve.metrics import GatewayMetrics, exposition_registry

REQUEST_ID_HEADER = "X-Request-Id"


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


def metrics_router(metrics: GatewayMetrics) -> APIRouter:
    """``GET /metrics``: ``metrics`` in Prometheus' text format (open, as Prometheus scrapes it)."""
    router = APIRouter()

    @router.get("/metrics")
    async def get_metrics() -> Response:
        return Response(generate_latest(exposition_registry(metrics.registry)), media_type=CONTENT_TYPE_LATEST)

    return router
