"""Log records of every server: one line per event, as text (default) or JSON, with the request id.

The request id travels with each request through every hop (gateway -> encoder -> prefill -> decode); a log line
about a request names it as ``rid=...`` in its message. Where code runs on behalf of one request without naming
it (a library call, a helper shared by many paths), :func:`request_context` names it for the log lines emitted
meanwhile: the gateway and the encoder (asyncio) set it per request, and tasks they start inherit it.

- text: ``time level logger: message``, plus `` rid=...`` when the context names a request the message does
  not already name.
- json: one object per line, ``{"time", "level", "logger", "message", "rid"?, "exc_info"?}``; ``rid`` comes
  from the context or from the message's ``rid=...``, so every line about a request carries it as a field.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import os
import re
import sys
from collections.abc import Iterator

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RID_IN_MESSAGE = re.compile(r"\brid=([A-Za-z0-9._:\-]+)")
_RID_ALLOWED = re.compile(r"[^A-Za-z0-9._:\-]")
MAX_RID_LEN = 128

# A ContextVar, not a global: each asyncio task (and each thread) sees its own value, copied to the tasks it
# starts, so concurrent requests never see each other's id.
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("epdserve_request_id", default=None)


def sanitize_request_id(value: str | None) -> str | None:
    """A client-supplied request id made safe for logs, metrics and wire messages, or None when nothing is left.

    Keeps ``[A-Za-z0-9._:-]`` (others dropped, so a header cannot forge log lines or JSON), at most
    :data:`MAX_RID_LEN` characters.
    """
    if not value:
        return None
    cleaned = _RID_ALLOWED.sub("", value)[:MAX_RID_LEN]
    return cleaned or None


def current_request_id() -> str | None:
    """The request id of the current context (set by :func:`request_context`), or None."""
    return _request_id.get()


@contextlib.contextmanager
def request_context(rid: str | None) -> Iterator[None]:
    """Name ``rid`` on the log lines emitted inside the block (and in tasks started inside it)."""
    token = _request_id.set(rid)
    try:
        yield
    finally:
        _request_id.reset(token)


def set_request_context(rid: str | None) -> None:
    """Name ``rid`` for the rest of the current task (an asyncio request handler: the task ends with it)."""
    _request_id.set(rid)


def _record_rid(record: logging.LogRecord) -> str | None:
    rid = getattr(record, "rid", None)
    if rid:
        return rid
    m = _RID_IN_MESSAGE.search(record.getMessage())
    return m.group(1) if m else None


class RequestIdFilter(logging.Filter):
    """Attach ``record.rid`` from the context (when the record has none); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "rid", None) is None:
            record.rid = _request_id.get()
        return True


class TextFormatter(logging.Formatter):
    """``time level logger: message``; appends `` rid=...`` when the context names a request the message does
    not name."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "rid", None)
        if rid and "rid=" not in record.getMessage():
            head, sep, tail = line.partition("\n")  # before a traceback, if any
            line = f"{head} rid={rid}{sep}{tail}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``rid`` (when
    the record is about a request) and ``exc_info`` (a formatted traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = _record_rid(record)
        if rid:
            out["rid"] = rid
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def make_formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``fmt`` (``text`` or ``json``).

    Raises:
        ValueError: another ``fmt``.
    """
    if fmt == "text":
        return TextFormatter()
    if fmt == "json":
        return JsonFormatter()
    raise ValueError(f"unknown log format {fmt!r}; expected one of {FORMATS}")


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Log epdserve's loggers at ``level`` and third-party ones at WARNING, to stderr, in ``fmt``.

    Replaces the root logger's handlers (a server process configures logging once, at start).

    Raises:
        ValueError: unknown ``fmt``.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("epdserve").setLevel(level)
    for noisy in ("transformers", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def active_format() -> str:
    """``json`` when the root logger writes JSON (so ``epdserve launch`` passes the same format to its
    children), else ``text``."""
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers) else "text"


def process_age_s() -> float | None:
    """Seconds since this process started, or None where ``/proc`` does not tell (not Linux).

    The interpreter's start and the imports run before any timer inside the process can; a start-up breakdown
    takes them from here: ``/proc/self/stat``'s start time (field 22, clock ticks after boot, proc(5)) against
    ``/proc/uptime``."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the command name may hold spaces: split after it
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def startup_summary(startup_s: dict[str, float]) -> str:
    """``"started in 41.2 s (weights 12.0 s, graphs 21.1 s, warm-up 8.1 s)"`` from seconds per part of a
    server's start-up, in the order they ran (a runner's
    :attr:`~epdserve.engine.model_runner.ModelRunner.startup_s`, the encoder's weights and warm-up)."""
    parts = ", ".join(f"{name} {sec:.1f} s" for name, sec in startup_s.items())
    return f"started in {sum(startup_s.values()):.1f} s ({parts})"
