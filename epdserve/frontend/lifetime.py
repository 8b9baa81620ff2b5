"""One request's life at a front: :class:`RequestLifetime` owns everything that must be given back when it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request

from epdserve.frontend.admission import Admission, Overloaded
from epdserve.frontend.errors import APIError
from epdserve.frontend.httputil import ClosingStreamingResponse, until_disconnect
from epdserve.frontend.stages import Stages

if TYPE_CHECKING:
    from epdserve.frontend.chat import PreparedChat
    from epdserve.frontend.observability import RequestIds

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class RequestLifetime:
    """A request from the moment the front takes it (its id is registered) to its end, however it ends: the answer
    sent, the client gone, the deadline, a stage error, a refusal.

    :meth:`close` runs exactly once: by the request path when the answer was not a stream, else when the stream is
    over (:meth:`stream`). It gives back the admission slot, forgets the request at the stages and aborts it there
    unless it finished (the stages know whether it did: a finished request has no route left), releases the request
    id, and records a stream cut short as a client disconnect.

    Args:
        rid: the request id.
        stages: the stages the request may be sent to.
        ids: the registry ``rid`` was taken from (the gateway's ``X-Request-Id`` check), or None.
    """

    def __init__(self, rid: str, stages: Stages, ids: RequestIds | None = None):
        self.rid = rid
        self._stages = stages
        self._ids = ids
        self._admission: Admission | None = None  # set while the request holds one of its slots
        self._staged = False  # it may have reached the stages (or an encoder, which pushes to prefill)
        self.prepared: PreparedChat | None = None
        self.streaming = False  # the answer is a stream, which closes this lifetime when it is over
        self.closed = False

    async def admit(self, request: Request | None, admission: Admission) -> None:
        """Wait for a slot of ``admission`` (given back by :meth:`close`). ``request``: the HTTP request whose
        client may leave meanwhile, or None where the transport cancels the waiting task itself (gRPC).

        Raises:
            APIError: 429 or 503 with ``Retry-After`` when admission control refuses the request.
            ClientGone: the client left while the request waited.
        """
        try:
            if request is None:
                await admission.acquire()
            else:
                await until_disconnect(request, admission.acquire())
        except Overloaded as e:
            raise APIError(e.status, e.message, headers={"Retry-After": str(e.retry_after_s)}) from None
        self._admission = admission

    def staging(self) -> None:
        """The request is about to be prepared: from now on it may be at the stages."""
        self._staged = True

    def stream(self, events: AsyncIterator[str]) -> ClosingStreamingResponse:
        """The SSE response of ``events``; it closes this lifetime once it is over (Starlette cancels ``events``
        when the client disconnects)."""
        self.streaming = True
        return ClosingStreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                                        on_close=self.close)

    def close(self) -> None:
        """End the request (idempotent): see the class docstring."""
        if self.closed:
            return
        self.closed = True
        if self._admission is not None:
            self._admission.release()
        if self._staged:
            self._stages.release(self.rid)  # before the id is free again: a new request may reuse it at once
        if self._ids is not None:
            self._ids.close(self.rid)
        if self.streaming and self.prepared is not None:
            self.prepared.trace.fail("client_disconnected", "abort")  # a no-op when the stream got to its end
