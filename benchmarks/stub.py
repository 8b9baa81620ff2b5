"""A stub OpenAI chat server with known, injected timings: the loopback calibration of the benchmark client.

Run against it, the benchmark must measure the injected TTFT and inter-token gap; whatever it measures beyond
them is the client's (and loopback's) own cost. The tests use it, and ``epdserve bench stub`` serves it so the
client can be checked on the machine that will run a real benchmark.

Each streamed answer: a role-only chunk at once (which must not count as the first token), then after
``ttft_s`` the first token chunk, then one token chunk every ``itl_s``, a finish chunk, a usage chunk and
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

IMAGE_TOKENS = 64  # prompt tokens the stub charges per image (a fixed stand-in for a real image processor)


@dataclass(frozen=True)
class StubBehavior:
    """What the stub does. Times in seconds; ``*_every = k`` hits every k-th request (1-based arrival order)."""

    ttft_s: float = 0.2
    itl_s: float = 0.05
    fail_every: int = 0  # answer HTTP 500 before streaming
    stream_error_every: int = 0  # send an error event halfway through the stream
    cached_tokens: int = 0  # reported in usage.prompt_tokens_details
    empty_text: bool = False  # stream every token as content "" (tokens that decode to nothing)
    default_max_tokens: int = 16


@dataclass
class StubState:
    """What the stub saw: request bodies and arrival times (``time.perf_counter()``), the peak in flight."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
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


def make_app(behavior: StubBehavior = StubBehavior(), model: str = "stub-model") -> FastAPI:
    """The stub's FastAPI app; ``app.state.stub`` is its :class:`StubState`."""
    app = FastAPI()
    state = app.state.stub = StubState()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "stub"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state.bodies.append(body)
        state.arrivals.append(time.perf_counter())
        k = len(state.bodies)
        if behavior.fail_every and k % behavior.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "stub"}}, status_code=500)
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or behavior.default_max_tokens)
        prompt = _prompt_tokens(body.get("messages", []))
        broken = bool(behavior.stream_error_every and k % behavior.stream_error_every == 0)
        return StreamingResponse(_stream(body, n, prompt, broken), media_type="text/event-stream")

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

    async def _stream(body: dict[str, Any], n: int, prompt: int, broken: bool):
        rid = f"chatcmpl-{len(state.bodies)}"
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        try:
            yield _chunk(rid, {"role": "assistant", "content": ""})
            await asyncio.sleep(behavior.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(behavior.itl_s)
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
        finally:
            state.in_flight -= 1

    return app


class StubServer:
    """Serve :func:`make_app` on 127.0.0.1 in a background thread (a context manager).

    ``url`` is the base URL (``http://127.0.0.1:PORT``); ``state`` what the server saw. The listening socket is
    bound before the thread starts, so the port is known and free of races.
    """

    def __init__(self, behavior: StubBehavior = StubBehavior(), model: str = "stub-model"):
        self.app = make_app(behavior, model)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def state(self) -> StubState:
        return self.app.state.stub

    def __enter__(self) -> StubServer:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._sock.close()


def serve(behavior: StubBehavior, host: str = "127.0.0.1", port: int = 8000, model: str = "stub-model") -> None:
    """Serve the stub in the foreground until interrupted."""
    uvicorn.run(make_app(behavior, model), host=host, port=port, log_level="warning", access_log=False)
