"""The gateway: the OpenAI-compatible HTTP server in front of one encoder pool and one or more prefill and decode
servers (:mod:`epdserve.gateway.stages`).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(:mod:`epdserve.frontend.openai`), ``POST /generate`` (:mod:`epdserve.frontend.native`), the Open Inference Protocol
v2 under ``/v2`` (:mod:`epdserve.frontend.kserve.http`; over gRPC on ``--kserve-grpc-port``:
:mod:`epdserve.gateway.kserve_grpc`), ``GET /health``
(readiness: 200 once the processor is loaded, a prefill and a decode server have answered and are up, and at least
one encoder serves, else 503 with the reason; ``?details=1`` adds a JSON body with every server's liveness and load,
a list per role, ``&fresh=1`` asks the prefill and decode servers for their load now), ``GET /health/live``
(liveness: 200 while the process answers at all), and ``GET /metrics``, ``/get_model_info``, ``/get_server_info``
(:mod:`epdserve.gateway.routes`). Every error is OpenAI error JSON; schema errors and malformed JSON are 400 (not
FastAPI's 422). Overload and stage failures answer 429/503 with ``Retry-After`` (see
:mod:`epdserve.frontend.admission`), the request deadline 504.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from epdserve.config import GatewayConfig
from epdserve.frontend.app import create_app as create_server_app
from epdserve.frontend.chat import PreparedChat
from epdserve.frontend.errors import APIError, StageError
from epdserve.frontend.httputil import server_config, until_disconnect
from epdserve.frontend.kserve.http import v2_router
from epdserve.frontend.lifetime import RequestLifetime
from epdserve.frontend.native.routes import native_router
from epdserve.frontend.observability import RequestIdHeader, metrics_router
from epdserve.frontend.openai.routes import openai_router
from epdserve.frontend.serving import Call, RequestPath
from epdserve.gateway.kserve_grpc import KServeGrpcServer
from epdserve.gateway.routes import gateway_router, not_ready
from epdserve.gateway.server import Gateway
from epdserve.gateway.stages import GatewayStages
from epdserve.logging_setup import set_request_context

__all__ = ["Gateway", "create_app", "main", "server_config"]

logger = logging.getLogger("epdserve.gateway")


class GatewayPath(RequestPath):
    """The gateway's request path: the client's ``X-Request-Id`` (unique in flight), readiness and stage checks,
    admission control, the ``--request-timeout-s`` deadline, and the outcome in the gateway's metrics."""

    server: Gateway

    async def open(self, request: Request) -> RequestLifetime:
        """The request id from ``X-Request-Id`` (or a new one), registered as in flight.

        Raises:
            APIError: 400 when that id is in flight already.
        """
        lifetime = self.take(request.headers.get("x-request-id"))
        request.state.rid = lifetime.rid
        return lifetime

    def take(self, rid: str | None) -> RequestLifetime:
        """``rid`` (or a new id) registered as in flight; its lifetime.

        Raises:
            APIError: 400 when that id is in flight already.
        """
        gw = self.server
        rid = gw.requests.open(rid)
        set_request_context(rid)  # this task serves one request: its log lines all name it
        return RequestLifetime(rid, gw.stages, gw.requests)

    async def answer(self, request: Request, lifetime: RequestLifetime, make_call: Callable[[], Call]) -> Response:
        """Check readiness and the stages, wait for admission, prepare under the deadline, answer.

        Raises:
            APIError: 503 while starting or with a stage down, 429/503 from admission control, or the request's
                own failure.
            ClientGone: the client left before the answer began.
        """
        call, prepared = await self.start(lifetime, make_call, request)
        if call.stream:
            return lifetime.stream(call.events(prepared))
        return call.response(await until_disconnect(request, call.complete(prepared)))

    async def start(self, lifetime: RequestLifetime, make_call: Callable[[], Call],
                    request: Request | None = None) -> tuple[Call, PreparedChat]:
        """Check readiness and the stages, wait for admission, prepare under the deadline.

        Raises:
            APIError: 503 while starting or with a stage down, 429/503 from admission control, or the request's
                own failure.
            ClientGone: the HTTP client left before the request was prepared.
        """
        gw = self.server
        if not gw.ready:
            raise APIError(503, "the server is starting: the stages are not ready yet")
        if (why := gw.stages.unavailable()) is not None:
            raise APIError.from_stage(StageError(why, 503))
        call = make_call()
        await lifetime.admit(request, gw.admission)
        timeout = gw.config.request_timeout_s
        deadline = time.monotonic() + timeout if timeout > 0 else None
        lifetime.staging()
        work = call.prepare(deadline)
        prepared = lifetime.prepared = await (work if request is None else until_disconnect(request, work))
        return call, prepared

    def failed(self, kind: str, outcome: str = "error") -> None:
        """Count the failure in the gateway's metrics."""
        self.server.metrics.on_failed(kind, outcome)


def create_app(config: GatewayConfig, stages: GatewayStages | None = None, *,
               startup_timeout_s: float = 300.0) -> FastAPI:
    """Build the gateway's FastAPI app.

    The stage handshake runs in the background from the app's lifespan, so the server answers ``/health`` (503)
    while the stages load.

    Args:
        config: the gateway config.
        stages: stage connections to use instead of ``GatewayStages(config)`` (tests inject fakes). The app starts
            and closes them.
        startup_timeout_s: how long to wait for prefill/decode/encoder to answer, in seconds.

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
    """
    gw = Gateway(config, stages, startup_timeout_s)

    async def authorize(request: Request) -> None:
        if not config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    path = GatewayPath(gw, logger)
    if config.kserve_grpc_port:
        gw.services.append(KServeGrpcServer(path, lambda: not_ready(gw), config.host, config.kserve_grpc_port,
                                            config.api_key))
    routers = [gateway_router(gw, authorize), metrics_router(gw.metrics), openai_router(path, authorize),
               native_router(path, authorize), v2_router(path, lambda: not_ready(gw), authorize)]
    return create_server_app(gw, routers, title="epdserve gateway", middleware=[RequestIdHeader])


def main(config: GatewayConfig) -> None:
    """Serve the gateway until interrupted (uvicorn, log level warning).

    Logs one line, ``gateway ready on http://HOST:PORT (model=NAME)``, once the HTTP server listens and the stages
    answered. Exits with status 1 if the stages cannot be reached in time.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    app = create_app(config)
    server = uvicorn.Server(server_config(app, config.host, config.port))
    if not asyncio.run(_serve(server, app.state.server)):
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
