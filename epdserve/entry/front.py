"""A prefill or decode server's HTTP front process (:mod:`epdserve.frontend.pd`): its app and its ``main``.

This is where the front is composed from the protocol packages, so it lives with the entry points rather than in
the front end's core (which imports no protocol): the app serves the OpenAI and native ``/generate`` routers behind
the PD front's request path, and ``--grpc-port`` adds the scheduler gRPC service of ``--grpc-protocol`` (SGLang's
or TokenSpeed's) on the same event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from epdserve.frontend.app import create_app
from epdserve.frontend.httputil import server_config
from epdserve.frontend.native.routes import native_router
from epdserve.frontend.openai.routes import openai_router
from epdserve.frontend.pd import Front, LegPath, SchedulerStages, front_router
from epdserve.frontend.process import die_with_parent
from epdserve.frontend.scheduler_client import SchedulerClient
from epdserve.logging_setup import configure_logging

logger = logging.getLogger("epdserve.front")


def create_front_app(front: Front) -> FastAPI:
    """The FastAPI app of a prefill or decode front: the OpenAI and native routers behind the front's
    :class:`~epdserve.frontend.pd.LegPath`, and :func:`~epdserve.frontend.pd.front_router`'s routes."""
    path = LegPath(front, logger)
    return create_app(front, [front_router(front), openai_router(path), native_router(path)],
                      title=f"epdserve {front.role}", error_headers=False)


def run_front(role: str, config_cls: type, make_stages: Callable[[Any, SchedulerClient], SchedulerStages],
              argv: list[str] | None = None) -> int:
    """The ``main`` of a ``role`` front's child process (``python -m epdserve.<role>.http_front CONFIG_JSON
    --parent-pid PID``): serve until SIGTERM.

    Args:
        config_cls: the server's config class (``CONFIG_JSON`` is one as JSON).
        make_stages: ``(config, scheduler client) ->`` the role's stages.
    """
    parser = argparse.ArgumentParser(prog=f"epdserve.{role}.http_front")
    parser.add_argument("config", help="the server's config as JSON")
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    config = config_cls(**json.loads(args.config))
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    # Started before the scheduler binds: its requests wait for the connection rather than fail.
    scheduler = SchedulerClient(f"tcp://{local}:{config.zmq_port}", role, immediate=False)
    front = Front(role, config.model_path, config.served_model_name or config.model_path,
                  make_stages(config, scheduler))
    if config.grpc_port:
        if config.grpc_protocol == "tokenspeed":
            from epdserve.frontend.tokenspeed.service import TokenSpeedGrpcServer as GrpcServer
        elif config.grpc_protocol == "sglang":
            from epdserve.frontend.sglang.service import SglangGrpcServer as GrpcServer
        else:
            raise SystemExit(f"--grpc-protocol {config.grpc_protocol!r}: expected 'sglang' or 'tokenspeed'")
        front.services.append(GrpcServer(front, config, config.host, config.grpc_port))
    asyncio.run(_serve_front(front, config))
    return 0


async def _serve_front(front: Front, config: Any) -> None:
    """Start the front's services (a port that cannot be bound ends the process), then serve HTTP on
    ``config.port`` until SIGTERM (the app's lifespan starts and closes the front), or without HTTP (port 0:
    gRPC only) start the front here and wait for SIGTERM or SIGINT."""
    for service in front.services:
        await service.start()
    if config.port:
        import uvicorn

        server = uvicorn.Server(server_config(create_front_app(front), config.host, config.port,
                                              graceful_shutdown_s=2))
        logger.info("%s front listening on http://%s:%d", front.role, config.host, config.port)
        await server.serve()
        return
    import signal

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    startup = asyncio.create_task(front.start())
    try:
        await stop.wait()
    finally:
        startup.cancel()
        await asyncio.gather(startup, return_exceptions=True)
        await front.close()
