"""The gateway's own routes: ``GET /health`` (readiness, ``?details=1`` every stage's liveness and load),
``GET /get_model_info`` and ``GET /get_server_info``; :func:`not_ready`, the one readiness rule of every
protocol."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

import epdserve
from epdserve.frontend.errors import APIError
from epdserve.gateway.server import Gateway

_ENCODER_INFO_TIMEOUT_S = 2.0


def gateway_router(gw: Gateway, authorize: Callable) -> APIRouter:
    """``/health`` (open) and ``/get_model_info``, ``/get_server_info`` (behind ``authorize``: they show the
    flags) of ``gw``."""
    router = APIRouter()

    @router.get("/health")
    async def health(details: bool = False, fresh: bool = False) -> Response:
        why = not_ready(gw)
        if why is None and not details:
            return Response(status_code=200)
        status = 200 if why is None else 503
        if not details:
            return JSONResponse(APIError(503, why).body().model_dump(), status_code=503)
        body = {"status": "ok" if why is None else "unavailable", "reason": why,
                "gateway": {"inflight": gw.admission.inflight, "queued": gw.admission.queued,
                            "at_stages": gw.stages.num_inflight if gw.ready else 0},
                "stages": await gw.stages.health(fresh) if gw.stages.servers else {}}
        return JSONResponse(body, status_code=status)

    @router.get("/get_model_info", dependencies=[Depends(authorize)])
    async def get_model_info() -> JSONResponse:
        if not gw.ready:
            raise APIError(503, "the server is starting: the stages are not ready yet")
        return JSONResponse(model_info(gw))

    @router.get("/get_server_info", dependencies=[Depends(authorize)])
    async def get_server_info() -> JSONResponse:
        return JSONResponse(await server_info(gw))

    return router


def not_ready(gw: Gateway) -> str | None:
    """Why ``gw`` cannot serve every kind of request it takes now (still starting, prefill or decode down, no
    encoder serving), or None: what ``/health``, ``/v2/health/ready`` and the v2 gRPC ``ServerReady`` answer."""
    if not gw.ready:
        return f"not ready: {gw.startup_error}" if gw.startup_error else "not ready: waiting for the stages"
    return gw.stages.not_ready()


def model_info(gw: Gateway) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` fields plus the stages' geometry (the gateway must be ready).

    With several servers of a role, the one with the smallest KV pool speaks for it (it bounds what a request may
    take). ``tp_size`` is that prefill server's TP ranks (one embedding endpoint each); ``kv_pool_tokens`` is a KV
    pool in tokens (pages x page size); ``num_servers`` counts the servers of each role.
    """
    infos = gw.stages.infos()

    def smallest(role: str):
        return min((i for i in infos if i.role == role), key=lambda i: i.num_pages * i.page_size)

    pre, dec = smallest("prefill"), smallest("decode")
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
        "num_servers": {"prefill": len(gw.stages.prefills), "decode": len(gw.stages.decodes)},
    }


async def server_info(gw: Gateway) -> dict[str, Any]:
    """The gateway's flags (the API key masked), readiness, every prefill and decode server's ``ServerInfo`` (a list
    per role, in flag order; null for one that never answered) and every encoder's ``GetServerInfo`` (or the error
    asking it)."""
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
        "prefill": [None if s.info is None else dataclasses.asdict(s.info) for s in stages.prefills],
        "decode": [None if s.info is None else dataclasses.asdict(s.info) for s in stages.decodes],
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
