"""A stub OpenAI chat server with known, injected timings: the loopback calibration of the benchmark client.

Run against it, the benchmark must measure the injected TTFT and inter-token gap; whatever it measures beyond
them is the client's (and loopback's) own cost. The tests use it, and ``epdserve bench stub`` serves it so the
client can be checked on the machine that will run a real benchmark.

:class:`StubServer` runs the stub in its own process, so that the benchmark client under test and the stub share
no GIL and no garbage collector: in one process a stall of either (a GC pass, the GIL held by the other thread)
delays the other, and the test would measure its own harness instead of the client.

Each streamed answer: a role-only chunk at once (which must not count as the first token), then
``ttft_s`` after the request's arrival the first token chunk, then one token chunk every ``itl_s``, a finish
chunk, a usage chunk and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

IMAGE_TOKENS = 64  # prompt tokens the stub charges per image (a fixed stand-in for a real image processor)
STATE_PATH = "/stub/state"  # GET: the stub's StubState as JSON (how StubServer reads it across the process border)
# A spawned child starts a fresh interpreter and imports starlette and uvicorn: about 0.3 s alone, seconds on a
# loaded 2-core CI machine; the limit only has to catch a child that will never start.
_START_TIMEOUT_S = 60.0
# uvicorn's graceful shutdown after SIGTERM takes ~0.2 s; a stream still open after this is cut (the stub's
# streams are all finite, so only a client that walked away leaves one).
_GRACEFUL_S = 1.0
_STOP_TIMEOUT_S = 5.0  # then SIGKILL


@dataclass(frozen=True)
class StubBehavior:
    """What the stub does. Times in seconds; ``*_every = k`` hits every k-th request (1-based arrival order)."""

    ttft_s: float = 0.2
    itl_s: float = 0.05
    fail_every: int = 0  # answer HTTP 500 before streaming
    stream_error_every: int = 0  # send an error event halfway through the stream
    cached_tokens: int = 0  # reported in usage.prompt_tokens_details
    empty_text: bool = False  # stream every token as content "" (tokens that decode to nothing)
    hold_open_s: float = 0.0  # keep the body open this long after data: [DONE] before ending it
    default_max_tokens: int = 16


@dataclass
class StubState:
    """What the stub saw: request bodies, arrival times and client ports (one port per TCP connection: how many
    connections the client opened), the peak in flight.

    ``arrivals`` are ``time.perf_counter()`` seconds *in the stub's process*. On Linux that clock is
    CLOCK_MONOTONIC, one system-wide clock, so they are comparable with the test process's own
    ``perf_counter()`` readings (differences between arrivals are meaningful on any platform).
    """

    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


def _prompt_tokens(messages: list[dict[str, Any]]) -> int:
    n = 0
    for m in messages:
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for p in parts:
            n += IMAGE_TOKENS if p.get("type") == "image_url" else len(str(p.get("text", "")).split())
    return n


async def _sleep_until(t: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``t`` (at once if it has)."""
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def make_app(behavior: StubBehavior = StubBehavior(), model: str = "stub-model") -> Starlette:
    """The stub's ASGI app (Starlette: a spawned :class:`StubServer` child imports it in ~0.2 s, FastAPI in ~0.6 s);
    ``app.state.stub`` is its :class:`StubState`.

    Token ``i`` of a request (0-based) is sent at ``arrival + ttft_s + i * itl_s``, deadlines counted from the
    request's arrival rather than sleeps chained after each send: the time the stub spends reading and parsing
    the body and starting the response, and a late wake-up of a busy process, then shift one token instead of
    adding to every later one. The stub's own lateness would otherwise show as the client's measurement error.
    """
    state = StubState()

    async def stub_state(request: Request) -> JSONResponse:
        return JSONResponse(dataclasses.asdict(state))

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "stub"}]})

    async def chat(request: Request):
        arrival = time.perf_counter()  # before the body is read: a real server's TTFT includes reading it
        body = await request.json()
        state.bodies.append(body)
        state.arrivals.append(arrival)
        state.client_ports.append(request.client.port if request.client else 0)
        k = len(state.bodies)
        if behavior.fail_every and k % behavior.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "stub"}}, status_code=500)
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or behavior.default_max_tokens)
        prompt = _prompt_tokens(body.get("messages", []))
        broken = bool(behavior.stream_error_every and k % behavior.stream_error_every == 0)
        return StreamingResponse(_stream(f"chatcmpl-{k}", arrival, body, n, prompt, broken),
                                 media_type="text/event-stream")

    def _chunk(rid: str, delta: dict[str, Any], finish: str | None = None, usage=None) -> str:
        obj = {
            "id": rid,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n"

    async def _stream(rid: str, arrival: float, body: dict[str, Any], n: int, prompt: int, broken: bool):
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        try:
            yield _chunk(rid, {"role": "assistant", "content": ""})
            for i in range(n):
                await _sleep_until(arrival + behavior.ttft_s + i * behavior.itl_s)
                if broken and i == n // 2:
                    yield f"data: {json.dumps({'error': {'message': 'injected stream error', 'code': 500}})}\n\n"
                    return
                yield _chunk(rid, {"content": "" if behavior.empty_text else f"t{i} "})
            yield _chunk(rid, {}, finish="length")
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                     "prompt_tokens_details": {"cached_tokens": behavior.cached_tokens}}
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _chunk(rid, {}, usage=usage)
            yield "data: [DONE]\n\n"
            if behavior.hold_open_s:
                await asyncio.sleep(behavior.hold_open_s)
        finally:
            state.in_flight -= 1

    app = Starlette(routes=[
        Route(STATE_PATH, stub_state),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ])
    app.state.stub = state
    return app


class StubServer:
    """Serve :func:`make_app` on 127.0.0.1 in a child process (a context manager).

    The child is started with the ``spawn`` context (a fresh interpreter: no copy of the test process's threads
    or locks), binds port 0 and sends the port back through a pipe once uvicorn is serving. ``url`` (the base
    URL, ``http://127.0.0.1:PORT``) is known from ``__enter__`` on; ``state`` fetches what the server saw
    (``GET /stub/state``). ``__exit__`` sends SIGTERM, waits up to 5 s, then SIGKILLs.

    Raises:
        RuntimeError: the child exited or did not serve within 60 s (from ``__enter__``), or ``url``/``state``
            were read outside the ``with`` block.
    """

    def __init__(self, behavior: StubBehavior = StubBehavior(), model: str = "stub-model"):
        self.behavior = behavior
        self.model = model
        self._url: str | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the stub server is not running (use it as a context manager)")
        return self._url

    @property
    def state(self) -> StubState:
        import httpx  # here, not at the top: the spawned child imports this module and never needs httpx (0.2 s)

        resp = httpx.get(self.url + STATE_PATH, timeout=10.0, trust_env=False)
        resp.raise_for_status()
        return StubState(**resp.json())

    def __enter__(self) -> StubServer:
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        # The behaviour travels as plain fields; daemon: a test process that dies takes its stub with it.
        self._proc = ctx.Process(target=_child_main, args=(writer, dataclasses.asdict(self.behavior), self.model),
                                 name="epdserve-bench-stub", daemon=True)
        self._proc.start()
        writer.close()  # the child holds the only write end now, so its death reads as EOF here
        try:
            if not reader.poll(_START_TIMEOUT_S):
                raise RuntimeError(f"stub server did not start within {_START_TIMEOUT_S:g} s")
            port = json.loads(reader.recv_bytes())["port"]
        except EOFError:
            self._proc.join(_STOP_TIMEOUT_S)
            code = self._proc.exitcode
            self._stop()
            raise RuntimeError(f"stub server exited during start (exit code {code})") from None
        except BaseException:
            self._stop()
            raise
        finally:
            reader.close()
        self._url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        proc, self._proc, self._url = self._proc, None, None
        if proc is None:
            return
        proc.terminate()
        proc.join(_STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()


def _child_main(conn: Connection, behavior: dict[str, Any], model: str) -> None:
    """The stub process: serve :func:`make_app` on 127.0.0.1:0 and send ``{"port": P}`` (JSON) on ``conn``
    once uvicorn is serving; return when uvicorn exits (SIGTERM). A failed start closes ``conn`` unsent."""
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and accepted
    # sockets inherit it from this one. Without it Nagle holds a chunk written right after another until the
    # client's delayed ACK (40 ms), which would show as the client's error on the role chunk's heels.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(StubBehavior(**behavior), model), log_level="warning", lifespan="off",
                            access_log=False, timeout_graceful_shutdown=_GRACEFUL_S)
    server = uvicorn.Server(config)

    async def serve_and_report() -> None:
        # Starlette's StreamingResponse runs in an anyio task group, whose asyncio backend anyio imports on first
        # use: tens of ms (far more on a loaded machine) that would land in the first request's TTFT.
        async with anyio.create_task_group():
            pass
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        if server.started:
            conn.send_bytes(json.dumps({"port": sock.getsockname()[1]}).encode())
        conn.close()
        await task

    try:
        asyncio.run(serve_and_report())
    finally:
        sock.close()


def serve(behavior: StubBehavior, host: str = "127.0.0.1", port: int = 8000, model: str = "stub-model") -> None:
    """Serve the stub in the foreground until interrupted."""
    uvicorn.run(make_app(behavior, model), host=host, port=port, log_level="warning", access_log=False)
