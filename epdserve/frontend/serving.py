"""The request path every protocol router calls: open a request, parse it, admit and prepare it, answer it.

A protocol package's router (``epdserve.frontend.openai``, ``epdserve.frontend.native``, ``epdserve.frontend.kserve``)
only turns its wire format into a :class:`Call` and hands it to :meth:`RequestPath.serve`. A protocol on another
transport (the KServe v2 gRPC service, ``epdserve.gateway.kserve_grpc``) drives the same pieces below HTTP:
:meth:`RequestPath.take` and :meth:`RequestPath.start` give it a :class:`~epdserve.frontend.lifetime.RequestLifetime`
and a prepared request for the server's :class:`~epdserve.frontend.chat.ChatService`.
A :class:`RequestPath` subclass says how this kind of server takes requests: the gateway's (``gateway/app.py``:
request ids, admission control, deadlines, metrics) or a PD front's (``epdserve.frontend.pd``: the router's
bootstrap fields).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.errors import APIError, ClientGone
from epdserve.frontend.httputil import parse_request
from epdserve.frontend.lifetime import RequestLifetime


@dataclass
class Call:
    """One parsed request, whatever its protocol: how to prepare it and how to answer it.

    Attributes:
        prepare: ``prepare(deadline)`` -> the stage requests (``deadline``: ``time.monotonic()`` value or None).
        stream: whether the client asked for SSE.
        events: the SSE events of a streamed answer.
        complete: the JSON body of a whole answer.
        as_event: a whole answer's body as the data of one SSE event (a prefill leg's streamed answer).
        response: the HTTP response of a whole answer's body (JSON by default; KServe v2 may answer binary).
    """

    prepare: Callable[[float | None], Awaitable[PreparedChat]]
    stream: bool
    events: Callable[[PreparedChat], AsyncIterator[str]]
    complete: Callable[[PreparedChat], Awaitable[Any]]
    as_event: Callable[[dict], str]
    response: Callable[[Any], Response] = JSONResponse


# (request id, the parsed body) -> its Call
CallFactory = Callable[[str, Any], Call]


async def no_auth() -> None:
    """The FastAPI dependency of a server without an API key (every protocol router's default)."""


class Server(Protocol):
    """What the app factory and the routers need from a server (the gateway, a PD front)."""

    model_name: str
    model_path: str
    chat: ChatService | None

    @property
    def ready(self) -> bool:
        """True once the server can take requests."""
        ...

    def max_model_len(self) -> int | None:
        """The context length for ``/v1/models``, or None while unknown."""
        ...

    async def start(self) -> None:
        """Load and connect (run in the background by the app; failures are the server's to keep)."""
        ...

    async def close(self) -> None:
        """Release everything :meth:`start` opened."""
        ...


class RequestPath:
    """How one server takes a request; subclasses fill in :meth:`open` and :meth:`answer`.

    Args:
        server: the server whose ``chat`` prepares and answers requests.
        logger: where request outcomes are logged.
    """

    def __init__(self, server: Server, logger: logging.Logger):
        self.server = server
        self.logger = logger

    async def serve(self, request: Request, schema: type[BaseModel] | None, make_call: CallFactory, *,
                    parse: Callable[[bytes], Any] | None = None) -> Response:
        """Serve one request whose body is a ``schema`` (or whatever ``parse(body)`` makes of it: a body that is
        not one JSON document); always ends its lifetime.

        Raises:
            APIError: the answer to a refused or failed request (FastAPI's handler writes it); an unexpected
                error becomes a 500.
        """
        lifetime = await self.open(request)
        rid = lifetime.rid
        try:
            if parse is not None:
                req = parse(await request.body())
            else:
                model = self.server.model_name if "model" in schema.model_fields else None
                req = parse_request(await request.body(), schema, model)
            # Built once the server is ready: until then it has no chat service.
            return await self.answer(request, lifetime, lambda: make_call(rid, req))
        except APIError as e:
            self.logger.info("rid=%s -> %d: %s", rid, e.status, e.message)
            self.failed(f"http_{e.status}")
            raise
        except ClientGone:
            self.logger.info("rid=%s client disconnected", rid)
            self.failed("client_disconnected", "abort")
            return Response(status_code=499)
        except Exception as e:  # keep serving: one bad request must not take the server down
            self.logger.exception("rid=%s internal error", rid)
            self.failed("internal")
            raise APIError(500, f"internal error: {e}") from None
        finally:
            if not lifetime.streaming:
                lifetime.close()

    async def open(self, request: Request) -> RequestLifetime:
        """Take the request: its id and its lifetime.

        Raises:
            APIError: the request is refused before it has anything to clean up.
        """
        raise NotImplementedError

    async def answer(self, request: Request, lifetime: RequestLifetime, make_call: Callable[[], Call]) -> Response:
        """Admit, prepare and answer the request's ``make_call()`` (call it once the server is ready); a stream
        hands ``lifetime`` to its response.

        Raises:
            APIError: refused or failed.
            ClientGone: the client left before the answer began.
        """
        raise NotImplementedError

    def take(self, rid: str | None) -> RequestLifetime:
        """Take a request that did not come as an HTTP request (gRPC): register ``rid`` (None or empty: a new id).

        Raises:
            APIError: the request is refused before it has anything to clean up (its id is in flight).
        """
        raise NotImplementedError

    async def start(self, lifetime: RequestLifetime, make_call: Callable[[], Call],
                    request: Request | None = None) -> tuple[Call, PreparedChat]:
        """Check readiness, admit and prepare ``make_call()`` (called once the server is ready); ``request``: the
        HTTP request whose client may leave meanwhile, or None where the transport cancels the task itself.

        Raises:
            APIError: refused or failed.
            ClientGone: the client left before the request was prepared.
        """
        raise NotImplementedError

    def failed(self, kind: str, outcome: str = "error") -> None:
        """Count a request that ended without an answer (``kind``: why; ``outcome``: its label)."""
