"""The errors of the front end: a stage's failure (:class:`StageError`), an HTTP answer (:class:`APIError`) and a
client that left (:class:`ClientGone`)."""

from __future__ import annotations

from pydantic import BaseModel

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "service_unavailable", 504: "timeout_error"}
# Seconds a client should wait before retrying after a stage went down: about one heartbeat, so a restarted stage
# is seen by then.
STAGE_RETRY_AFTER_S = 2


class ErrorInfo(BaseModel):
    """One error: what went wrong, its type, the request field at fault and a code (the HTTP status unless
    named)."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The error body every route but KServe's answers with (OpenAI's shape, which SGLang's and vLLM's routes
    share): ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StageError(Exception):
    """A stage refused or failed a request. ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.message = message
        self.status = status


class APIError(Exception):
    """An error answered as error JSON (:class:`ErrorResponse`) with HTTP ``status`` (and ``headers``, e.g.
    ``Retry-After``)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers

    @classmethod
    def from_stage(cls, e: StageError) -> APIError:
        """The answer to a :class:`StageError`: its status and message; a 503 says when to retry."""
        headers = {"Retry-After": str(STAGE_RETRY_AFTER_S)} if e.status == 503 else None
        return cls(e.status, e.message, headers=headers)

    def body(self) -> ErrorResponse:
        """The error JSON body."""
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


class GenerationFailed(APIError):
    """A stage reported an error for the request (HTTP 500)."""


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""
