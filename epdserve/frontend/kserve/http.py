"""The Open Inference Protocol (v2) over HTTP/REST, as KServe and Triton serve it, over a server's
:class:`~epdserve.frontend.serving.RequestPath` (tensors and their meaning: :mod:`epdserve.frontend.kserve.v2`).

Routes: ``GET /v2`` (server metadata), ``GET /v2/health/live``, ``GET /v2/health/ready`` (200, else 503 with the
reason), ``GET /v2/models/{name}`` (model metadata), ``GET /v2/models/{name}/ready``, ``POST
/v2/models/{name}/infer``, and Triton's generate extension: ``POST /v2/models/{name}/generate`` (one JSON object of
inputs in, ``{"model_name", "model_version", "text_output", ...}`` out) and ``/generate_stream`` (one SSE event
per text delta). Each model route also answers under ``/v2/models/{name}/versions/1/...``. ``infer`` speaks
Triton's binary tensor data extension (``Inference-Header-Content-Length``), which ``tritonclient.http`` uses by
default. Errors are ``{"error": "message"}`` (the protocol's shape, written by the app's error handler for every
``/v2`` route) with 400 for bad input, 404 for another model, 401 without the API key.
The health routes are open (probes); the others are behind the server's API key.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.errors import APIError, GenerationFailed
from epdserve.frontend.httputil import describe_validation_error
from epdserve.frontend.kserve.v2 import (
    INPUTS, Tensor, V2Output, V2Request, check_model, model_metadata, output_values, parse_v2, prepare, raw_bytes,
    raw_values, server_metadata, v2_collect, v2_stream,
)
from epdserve.frontend import logger
from epdserve.frontend.serving import Call, RequestPath, no_auth

HEADER_LENGTH = "Inference-Header-Content-Length"  # Triton's binary tensor data extension


class _Input(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: Any = None


class _Output(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class _InferBody(BaseModel):
    """The JSON part of a v2 ``infer`` request."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[_Input]
    outputs: list[_Output] | None = None


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    return [x for item in data for x in _flatten(item)]


def _json_values(datatype: str, data: Any, name: str) -> list | None:
    """The elements of a tensor given as JSON ``data`` (nested lists flattened): BYTES strings as UTF-8 bytes,
    BOOL as bools; None for datatypes no input has. Raises APIError 400 for an element of the wrong JSON type."""
    if datatype not in ("BYTES", "BOOL") or data is None:
        return None
    want = str if datatype == "BYTES" else bool
    values = _flatten(data)
    if not all(isinstance(v, want) for v in values):
        raise APIError(400, f"input {name!r}: {datatype} data must be JSON {want.__name__} values", param=name)
    return [v.encode() for v in values] if datatype == "BYTES" else values


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(body):
        raise APIError(400, f"{HEADER_LENGTH} {header_length!r} is not a length within the body")
    return body[:n], body[n:]


def parse_infer(body: bytes, header_length: str | None, model: str, rid: str) -> tuple[V2Request, _InferBody]:
    """A v2 ``infer`` body (JSON, then the binary tensors when ``header_length`` is given) as a request.

    Raises:
        APIError: 400 for malformed JSON or binary data or any input problem (:func:`parse_v2`).
    """
    head, binary = _split_body(body, header_length)
    try:
        doc = _InferBody.model_validate_json(head)
    except ValidationError as e:
        raise APIError(400, describe_validation_error(e)) from None
    tensors, at = [], 0
    for t in doc.inputs:
        size = (t.parameters or {}).get("binary_data_size")
        if size is None:
            values = _json_values(t.datatype, t.data, t.name)
        elif not isinstance(size, int) or size < 0 or at + size > len(binary):
            raise APIError(400, f"input {t.name!r}: binary_data_size {size!r} runs past the body", param=t.name)
        else:
            values, at = raw_values(t.datatype, binary[at:at + size]), at + size
        tensors.append(Tensor(t.name, t.datatype, t.shape, values))
    outputs = [o.name for o in doc.outputs or []] or None
    return parse_v2(model, doc.id or rid, tensors, doc.parameters or {}, outputs), doc


def infer_response(req: V2Request, doc: _InferBody, out: V2Output) -> Response:
    """The v2 ``infer`` answer: JSON, with each output asked for in binary (``binary_data_output``, or the
    output's ``binary_data``) appended after it."""
    binary_all = bool((doc.parameters or {}).get("binary_data_output", False))
    per_output = {o.name: (o.parameters or {}).get("binary_data") for o in doc.outputs or []}
    outputs, blobs = [], []
    for name, datatype, values in output_values(req, out):
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [len(values)]}
        if per_output.get(name, binary_all):
            blobs.append(raw_bytes(datatype, values))
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = [v.decode() if isinstance(v, bytes) else v for v in values]
        outputs.append(tensor)
    head = json.dumps({"model_name": req.model, "model_version": "1", "id": req.id,
                       "outputs": outputs}, ensure_ascii=False).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(head))})


def parse_generate(body: bytes, model: str, rid: str, stream: bool = False) -> V2Request:
    """A Triton ``generate`` body: one JSON object of inputs by name (strings BYTES, booleans BOOL, lists of
    strings several BYTES elements, ``sampling_parameters`` a JSON string or object) and ``parameters``;
    ``stream``: the request's ``stream`` when it gives none.

    Raises:
        APIError: 400 for malformed JSON or any input problem (:func:`parse_v2`).
    """
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as e:
        raise APIError(400, f"invalid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("parameters", {}), dict):
        raise APIError(400, "the body must be a JSON object (and its 'parameters' an object)")
    tensors = []
    for name, value in doc.items():
        if name in ("parameters", "id"):
            continue
        if name == "sampling_parameters" and isinstance(value, dict):
            value = json.dumps(value)
        values = value if isinstance(value, list) else [value]
        kind = {str: "BYTES", bool: "BOOL"}.get(type(values[0]) if values else str, "")
        if name in INPUTS and kind:
            values = _json_values(kind, values, name)
        tensors.append(Tensor(name, kind, [len(values)], values))
    return parse_v2(model, str(doc.get("id") or rid), tensors, doc.get("parameters", {}), None, stream)


def _generate_body(req: V2Request, out: V2Output) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": req.model, "model_version": "1"}
    for name, _, (value,) in output_values(req, out):
        body[name] = value.decode() if isinstance(value, bytes) else value
    return body


async def _events(chat: ChatService, prepared: PreparedChat, req: V2Request) -> AsyncIterator[str]:
    """``generate_stream``'s SSE events; a failure once streaming has begun is a ``{"error": ...}`` event (Triton's
    shape), recorded in the request's trace."""
    try:
        if not req.stream:
            yield f"data: {json.dumps(_generate_body(req, await v2_collect(chat, prepared, req)))}\n\n"
            return
        async with aclosing(v2_stream(chat, prepared, req)) as outputs:
            async for out in outputs:
                yield f"data: {json.dumps(_generate_body(req, out), ensure_ascii=False)}\n\n"
    except APIError as e:
        prepared.trace.fail("generation_failed" if isinstance(e, GenerationFailed) else f"http_{e.status}")
        yield f"data: {json.dumps({'error': e.message})}\n\n"
    except Exception as e:
        logger.exception("rid=%s stream failed", prepared.rid)
        prepared.trace.fail("internal")
        yield f"data: {json.dumps({'error': f'internal error: {e}'})}\n\n"


def _call(chat: ChatService, rid: str, req: V2Request, response: Callable[[V2Output], Any], sse: bool = False) -> Call:
    """The :class:`Call` of ``req``: answered by ``response(output)``, or as SSE events (``sse``)."""
    return Call(lambda deadline: prepare(chat, rid, req, deadline), sse, lambda p: _events(chat, p, req),
                lambda p: v2_collect(chat, p, req), json.dumps, response)


def v2_router(path: RequestPath, not_ready: Callable[[], str | None], authorize: Callable = no_auth) -> APIRouter:
    """The v2 routes of ``path``'s server; ``not_ready()``: why it cannot serve now (None: ready), read by the
    readiness routes; ``authorize``: the FastAPI dependency of the other routes."""
    router = APIRouter()
    server = path.server
    auth = [Depends(authorize)]

    def model(name: str) -> str:
        name, _, version = name.partition("/versions/")
        check_model(name, version, server.model_name)
        return name

    async def serve(request: Request, parse: Callable[[bytes, str], Any], make_call: Callable[[str, Any], Call],
                    stream: bool | None) -> Response:
        def parsed(body: bytes) -> Any:
            req = parse(body, getattr(request.state, "rid", ""))
            v2 = req[0] if isinstance(req, tuple) else req
            if stream is not None and v2.stream != stream:
                where = "generate_stream or gRPC ModelStreamInfer" if v2.stream else "generate"
                raise APIError(400, f"stream={str(v2.stream).lower()} is served by {where}", param="stream")
            return req
        return await path.serve(request, None, make_call, parse=parsed)

    @router.get("/v2/health/live")
    async def live() -> Response:
        return JSONResponse({"live": True})

    @router.get("/v2/health/ready")
    async def ready() -> Response:
        why = not_ready()
        return JSONResponse({"ready": why is None} | ({"error": why} if why else {}), status_code=503 if why else 200)

    @router.get("/v2", dependencies=auth)
    async def metadata() -> Response:
        return JSONResponse(server_metadata())

    @router.get("/v2/models/{name:path}/ready")
    async def model_ready(name: str) -> Response:
        model(name)
        return await ready()

    @router.post("/v2/models/{name:path}/infer", dependencies=auth)
    async def infer(name: str, request: Request) -> Response:
        def parse(body: bytes, rid: str) -> tuple[V2Request, _InferBody]:
            return parse_infer(body, request.headers.get(HEADER_LENGTH), model(name), rid)

        return await serve(request, parse, lambda rid, r: _call(server.chat, rid, r[0], lambda out: infer_response(
            r[0], r[1], out)), stream=False)

    @router.post("/v2/models/{name:path}/generate", dependencies=auth)
    async def generate(name: str, request: Request) -> Response:
        return await serve(request, lambda body, rid: parse_generate(body, model(name), rid),
                           lambda rid, r: _call(server.chat, rid, r, lambda out: JSONResponse(_generate_body(r, out))),
                           stream=False)

    @router.post("/v2/models/{name:path}/generate_stream", dependencies=auth)
    async def generate_stream(name: str, request: Request) -> Response:
        # Streamed unless the body says `stream: false`, which asks for the whole text as one event.
        return await serve(request, lambda body, rid: parse_generate(body, model(name), rid, stream=True),
                           lambda rid, r: _call(server.chat, rid, r, JSONResponse, sse=True), stream=None)

    @router.get("/v2/models/{name:path}", dependencies=auth)
    async def model_metadata_route(name: str) -> Response:
        return JSONResponse(model_metadata(model(name)))

    return router
