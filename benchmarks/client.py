"""One streamed chat completion, timed: the request body and the SSE reader that fills a :class:`RequestRecord`.

Timing rules (the same as SGLang's ``bench_serving``, close to vLLM's ``bench serve``):

* the clock starts just before the request is written, after any wait for a ``--max-concurrency`` slot;
* a *token chunk* is a streamed ``choices[0].delta`` with non-empty ``content`` (or ``reasoning_content``);
  a role-only announcement or an empty delta is not one, so a server that sends ``{"role": "assistant"}``
  at once does not fake a small TTFT;
* TTFT is the arrival of the first token chunk; ITL is every gap between consecutive token chunks (a server
  that streams several tokens per chunk shows fewer, longer gaps; TPOT is per token regardless);
* when no chunk has text (every token decoded to nothing), TTFT falls back to the first non-role choice chunk;
* end-to-end latency ends at ``data: [DONE]``; the body is then read on to its end (normally the closing chunk,
  at once), so the connection goes back to the pool: a response closed mid-body closes its connection, and the
  next request would pay a TCP connect inside its TTFT;
* TPOT is ``(e2e - ttft) / (completion_tokens - 1)``, with ``completion_tokens`` from ``usage``.

All times in a record are seconds (``*_s``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .datasets import BenchRequest

_MAX_ERROR_CHARS = 300  # an error message is a grouping key; a whole HTML error page is not a useful one
# How long to wait, after data: [DONE], for the body's end. Servers end it at once; one that keeps it open only
# loses its connection (closed, not reused) and holds the request's --max-concurrency slot this long.
_DRAIN_AFTER_DONE_S = 0.25


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; ``*_s`` offsets count from the benchmark's start.

    ``completion_tokens`` falls back to the number of token chunks, and ``prompt_tokens`` to the dataset's text
    estimate, when the server sends no ``usage`` (then ``usage_reported`` is false).
    """

    index: int
    group: str = ""
    num_images: int = 0
    text_tokens_est: int = 0
    max_completion_tokens: int = 0
    scheduled_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    num_chunks: int = 0
    num_events: int = 0
    client_overhead_s: float = 0.0
    output_text: str | None = None

    def chunk_times_s(self) -> list[float]:
        """Arrival of each token chunk, in seconds since the benchmark's start."""
        if self.ttft_s is None or self.num_chunks == 0:
            return []
        t = self.start_s + self.ttft_s
        times = [t]
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times


def request_body(
    req: BenchRequest,
    model: str,
    *,
    ignore_eos: bool = True,
    temperature: float | None = None,
    extra_body: dict[str, Any] | None = None,
) -> bytes:
    """The JSON body for ``/v1/chat/completions``, serialized once before the run so that building it never
    counts towards a request's latency. ``extra_body`` fields override everything else."""
    body: dict[str, Any] = {
        "model": model,
        "messages": req.messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": req.max_completion_tokens,
        "ignore_eos": ignore_eos,
        **req.extra,
    }
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra_body or {})
    return json.dumps(body, separators=(",", ":")).encode()


def _error_text(status: int, raw: bytes) -> str:
    """``HTTP <status>: <message>`` with the message taken from an OpenAI/FastAPI error body when there is one."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj.get("detail", obj.get("message", text)))
        text = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {text or 'empty body'}"[:_MAX_ERROR_CHARS]


def _stream_error_text(obj: dict[str, Any]) -> str:
    err = obj["error"]
    msg = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
    return f"stream error: {msg}"[:_MAX_ERROR_CHARS]


class _Stream:
    """What one streamed chat response has shown so far (times are ``time.perf_counter()`` seconds)."""

    def __init__(self, start: float, keep_text: bool) -> None:
        self.start, self.keep_text = start, keep_text
        self.last: float | None = None  # arrival of the latest chunk with text
        self.first_choice: float | None = None  # arrival of the first chunk with a choice that is not the role
        self.end: float | None = None  # arrival of data: [DONE]
        self.usage: dict[str, Any] | None = None
        self.text: list[str] = []

    def feed(self, record: RequestRecord, raw: bytes, now: float) -> str | None:
        """One line of the body (its newline included), arrived at ``now``. Returns ``"done"`` at ``data: [DONE]``,
        ``"error"`` after an error event (``record.error`` set), else None.

        Raises:
            json.JSONDecodeError: a data line that is not JSON.
        """
        record.num_events += 1
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line.startswith("data:"):
            return None  # blank separators, ": keep-alive" comments, "event:" fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.end = now
            return "done"
        obj = json.loads(payload)
        if "error" in obj:
            record.error = _stream_error_text(obj)
            return "error"
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if not choices:
            return None
        delta = choices[0].get("delta") or {}
        if "role" not in delta:
            self.first_choice = self.first_choice or now
        piece = delta.get("content") or delta.get("reasoning_content")
        if piece:
            if self.last is None:
                record.ttft_s = now - self.start
            else:
                record.itl_s.append(now - self.last)
            self.last = now
            record.num_chunks += 1
            if self.keep_text:
                self.text.append(piece)
        return None

    def finish(self, record: RequestRecord) -> RequestRecord:
        """Fill the request-level figures of a stream that reached ``[DONE]`` (or set ``record.error``)."""
        if self.end is None:
            record.error = "stream closed before data: [DONE]"
            return record
        if record.ttft_s is None:
            if self.first_choice is None:
                record.error = "stream had no choices"
                return record
            # Every token decoded to empty text (e.g. only special tokens, which servers skip): the first chunk
            # after the role announcement (often the finish chunk) is the earliest evidence of a generated token.
            record.ttft_s = self.first_choice - self.start
        record.e2e_s = self.end - self.start
        _apply_usage(record, self.usage)
        if record.completion_tokens and record.completion_tokens > 1:
            record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
        if self.keep_text:
            record.output_text = "".join(self.text)
        record.success = True
        return record


async def stream_chat(
    client: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: RequestRecord,
    t0: float,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
    keep_text: bool = False,
) -> RequestRecord:
    """Send one streamed chat request and fill ``record`` (also returned). Never raises for a failed request:
    HTTP errors, error events in the stream, malformed streams, connection errors and timeouts set
    ``record.error``. ``t0`` is the benchmark's ``time.perf_counter()`` origin; ``timeout_s`` bounds the whole
    request (connect to ``[DONE]``)."""
    st = time.perf_counter()
    record.start_s = st - t0
    stream = _Stream(st, keep_text)
    overhead = 0.0
    try:
        async with asyncio.timeout(timeout_s) as request_timeout:
            async with client.post(url, data=body, headers=headers) as resp:
                record.http_status = resp.status
                if resp.status != 200:
                    record.error = _error_text(resp.status, await resp.read())
                    return record
                async for raw in resp.content:  # one line per iteration, its b"\n" included
                    now = time.perf_counter()  # the chunk's arrival; everything until the next await is overhead
                    try:
                        status = stream.feed(record, raw, now)
                    finally:
                        overhead += time.perf_counter() - now
                    if status == "error":
                        return record
                    if status == "done":
                        break
                if stream.end is not None:
                    request_timeout.reschedule(None)  # the request is complete: the drain has its own bound
                    await _drain(resp)
    except TimeoutError:
        record.error = f"timeout after {timeout_s:g} s"
        return record
    except json.JSONDecodeError as e:
        record.error = f"malformed stream: invalid JSON in a data line ({e.msg})"
        return record
    except (aiohttp.ClientError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS] if str(e) else type(e).__name__
        return record
    except Exception as e:  # a stream this reader cannot follow is a failed request, never a lost one
        record.error = f"client error: {type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
        return record
    finally:
        record.end_s = time.perf_counter() - t0
        record.client_overhead_s = overhead
    return stream.finish(record)


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read ``resp``'s remaining body to its end, for at most ``_DRAIN_AFTER_DONE_S``.

    Called after ``data: [DONE]``: only a response read to its end leaves its HTTP/1.1 connection reusable
    (aiohttp closes one that is released mid-body). Whatever follows ``[DONE]`` is ignored, and so is a server
    that keeps the body open or drops the connection now: the request is already complete.
    """
    try:
        async with asyncio.timeout(_DRAIN_AFTER_DONE_S):
            await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass


def _apply_usage(record: RequestRecord, usage: dict[str, Any] | None) -> None:
    if usage is None:
        record.prompt_tokens = record.text_tokens_est
        record.completion_tokens = record.num_chunks
        return
    record.usage_reported = True
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
