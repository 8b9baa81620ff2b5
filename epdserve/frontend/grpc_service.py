"""The gRPC server around one servicer of a front: the KServe v2 service on the gateway, SGLang's scheduler
service on the prefill/decode fronts. Both bind, start and stop the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger("epdserve.front")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # images, pixel tensors and image files travel inside one request


class GrpcService:
    """A ``grpc.aio`` server serving ``servicer`` on ``host``:``port`` from :meth:`start` to :meth:`stop`, with
    messages of up to 256 MB.

    Args:
        servicer: the service's implementation.
        add_to_server: the generated ``add_<Service>Servicer_to_server`` function.
        host: the address to bind (an IPv6 address is bracketed here).
        port: the port (0: any free one).
        what: the service's name, for errors and the log line.
    """

    def __init__(self, servicer: Any, add_to_server: Callable[[Any, grpc.aio.Server], None], host: str, port: int,
                 what: str):
        self.servicer, self._add_to_server = servicer, add_to_server
        self.host, self.port, self.what = host, port, what
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind and serve.

        Raises:
            OSError: the port cannot be bound.
        """
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self._add_to_server(self.servicer, server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        try:
            bound = server.add_insecure_port(f"{host}:{self.port}")
        except RuntimeError as e:
            raise OSError(f"cannot bind the {self.what} port {host}:{self.port}: {e}") from None
        if not bound:
            raise OSError(f"cannot bind the {self.what} port {host}:{self.port}")
        await server.start()
        self._server = server
        logger.info("%s on %s:%d", self.what, self.host, bound)

    async def stop(self) -> None:
        """Stop serving; requests in flight get a second to finish (their ends abort them at the stages)."""
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
