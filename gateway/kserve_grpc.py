"""The Open Inference Protocol (v2) over gRPC: ``inference.GRPCInferenceService`` of KServe and Triton
(``proto/grpc_predict_v2.proto``, with Triton's ``ModelStreamInfer``), served by the gateway on
``--kserve-grpc-port`` beside its HTTP port, on the same event loop and through the same request path (request ids,
readiness, admission, deadline, metrics) as every HTTP route.

RPCs: ``ServerLive`` (true while the process answers), ``ServerReady`` and ``ModelReady`` (false while the gateway
starts, prefill or decode is down or no encoder serves: what ``/health`` says), ``ServerMetadata``,
``ModelMetadata``, ``ModelInfer`` (one whole answer) and ``ModelStreamInfer`` (one response per text delta when
the request's ``stream`` is true, each with the parameter ``triton_final_response``, true on the last; the
requests of one stream run concurrently). Tensors: :mod:`epdserve.frontend.kserve.v2`; outputs travel as
``raw_output_contents``, as Triton sends them. A request's id is its ``id`` field, else the ``x-request-id``
metadata, else a new one. Errors: a status code (INVALID_ARGUMENT for bad input, NOT_FOUND for another model,
UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...); on a stream, a response with ``error_message`` and the
stream goes on. With ``--api-key`` every RPC but the three health ones needs ``authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import grpc

from epdserve.frontend.errors import APIError
from epdserve.frontend.grpc_service import GrpcService
from epdserve.frontend.kserve.v2 import (
    Tensor, V2Output, V2Request, check_model, model_metadata, output_values, parse_v2, prepare, raw_bytes,
    raw_values, server_metadata, v2_collect, v2_stream,
)
from epdserve.frontend.serving import Call, RequestPath
from epdserve.proto import grpc_predict_v2_pb2 as pb
from epdserve.proto import grpc_predict_v2_pb2_grpc as pb_grpc

logger = logging.getLogger("epdserve.gateway")

# Images and videos come inside the request: as large as the gateway's media limits allow (the encoder's size).
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status of an :class:`APIError`'s HTTP status."""
    return _CODES.get(http_status, grpc.StatusCode.INTERNAL if http_status >= 500 else grpc.StatusCode.UNKNOWN)


def _param(p: pb.InferParameter):
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def _tensors(req: pb.ModelInferRequest) -> list[Tensor]:
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise APIError(400, f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs")
    out = []
    for i, t in enumerate(req.inputs):
        if raw:
            values = raw_values(t.datatype, raw[i])
        else:
            values = {"BYTES": t.contents.bytes_contents, "BOOL": t.contents.bool_contents}.get(t.datatype)
        out.append(Tensor(t.name, t.datatype, list(t.shape), None if values is None else list(values)))
    return out


def parse_request(req: pb.ModelInferRequest, model: str, rid: str) -> V2Request:
    """A ``ModelInferRequest`` as a validated :class:`V2Request` (request parameters of any type).

    Raises:
        APIError: 404 for another model, 400 for any input problem (:func:`~epdserve.frontend.kserve.v2.parse_v2`).
    """
    check_model(req.model_name, req.model_version, model)
    params = {k: _param(v) for k, v in req.parameters.items()}
    return parse_v2(model, req.id or rid, _tensors(req), params, [o.name for o in req.outputs] or None)


def infer_response(req: V2Request, out: V2Output, streamed: bool) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of ``out``; ``streamed``: flag it with ``triton_final_response``."""
    resp = pb.ModelInferResponse(model_name=req.model, model_version="1", id=req.id)
    for name, datatype, values in output_values(req, out):
        resp.outputs.add(name=name, datatype=datatype, shape=[len(values)])
        resp.raw_output_contents.append(raw_bytes(datatype, values))
    if streamed:
        resp.parameters["triton_final_response"].bool_param = out.final
    return resp


class V2Servicer(pb_grpc.GRPCInferenceServiceServicer):
    """The v2 RPCs over ``path`` (its server's ``model_name`` and ``chat``).

    Args:
        path: the gateway's request path.
        not_ready: why the server cannot serve now, or None.
        api_key: the key every non-health RPC must send as ``authorization: Bearer KEY`` ("" = none).
    """

    def __init__(self, path: RequestPath, not_ready: Callable[[], str | None], api_key: str = ""):
        self.path, self.not_ready, self.api_key = path, not_ready, api_key

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self.api_key:
            return
        scheme, _, token = dict(context.invocation_metadata() or ()).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                                "(send the metadata 'authorization: Bearer <key>')")

    async def _model(self, name: str, version: str, context: grpc.aio.ServicerContext) -> None:
        try:
            check_model(name, version, self.path.server.model_name)
        except APIError as e:
            await context.abort(status_code(e.status), e.message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.not_ready() is None)

    async def ModelReady(self, request, context):
        await self._model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self.not_ready() is None)

    async def ServerMetadata(self, request, context):
        await self._authorize(context)
        return pb.ServerMetadataResponse(**server_metadata())

    async def ModelMetadata(self, request, context):
        await self._authorize(context)
        await self._model(request.name, request.version, context)
        md = model_metadata(request.name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=md["name"], versions=md["versions"], platform=md["platform"],
                                        inputs=[tensor(**t) for t in md["inputs"]],
                                        outputs=[tensor(**t) for t in md["outputs"]])

    async def ModelInfer(self, request, context):
        await self._authorize(context)
        answers: list[pb.ModelInferResponse] = []

        async def emit(req: V2Request, out: V2Output) -> None:
            answers.append(infer_response(req, out, streamed=False))

        try:
            await self.serve(request, context, emit, streaming=False)
        except APIError as e:
            await context.abort(status_code(e.status), e.message)
        return answers[0]

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        await self._authorize(context)
        queue: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        async def one(request: pb.ModelInferRequest) -> None:
            async def emit(req: V2Request, out: V2Output) -> None:
                await queue.put(pb.ModelStreamInferResponse(infer_response=infer_response(req, out, streamed=True)))

            try:
                await self.serve(request, context, emit, streaming=True)
            except APIError as e:
                failed = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
                await queue.put(pb.ModelStreamInferResponse(error_message=e.message, infer_response=failed))

        async def read() -> None:
            async for request in request_iterator:
                tasks.append(asyncio.create_task(one(request)))
            await asyncio.gather(*tasks)
            await queue.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:  # the client went away (or the stream is over): every request still running is aborted
            for task in (reader, *tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def serve(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext,
                    emit: Callable[[V2Request, V2Output], Awaitable[None]], streaming: bool) -> None:
        """Serve one request through the request path, handing each answer to ``emit``; always ends its lifetime.

        Raises:
            APIError: refused or failed (counted in the metrics); an unexpected error becomes a 500.
        """
        path = self.path
        metadata = dict(context.invocation_metadata() or ())
        lifetime = path.take(request.id or metadata.get("x-request-id"))
        rid = lifetime.rid
        try:
            req = parse_request(request, path.server.model_name, rid)
            if req.stream and not streaming:
                raise APIError(400, "stream=true is served by ModelStreamInfer", param="stream")
            chat = path.server.chat
            # Only prepare is used: the answer is driven below, in this protocol's own messages.
            _, prepared = await path.start(lifetime, lambda: Call(
                lambda deadline: prepare(chat, rid, req, deadline), req.stream, None, None, None))
            if not req.stream:
                await emit(req, await v2_collect(chat, prepared, req))
                return
            async with aclosing(v2_stream(chat, prepared, req)) as outputs:
                async for out in outputs:
                    await emit(req, out)
        except APIError as e:
            logger.info("rid=%s -> %d: %s", rid, e.status, e.message)
            path.failed(f"http_{e.status}")
            raise
        except asyncio.CancelledError:
            logger.info("rid=%s client cancelled", rid)
            path.failed("client_disconnected", "abort")
            raise
        except Exception as e:  # keep serving: one bad request must not take the service down
            logger.exception("rid=%s internal error", rid)
            path.failed("internal")
            raise APIError(500, f"internal error: {e}") from None
        finally:
            lifetime.close()


class KServeGrpcServer(GrpcService):
    """The v2 gRPC server of one gateway on ``host``:``port`` (a ``Gateway`` service: :meth:`start` before the
    stages load, :meth:`stop` on shutdown).

    Args:
        path, not_ready, api_key: as :class:`V2Servicer`.
    """

    def __init__(self, path: RequestPath, not_ready: Callable[[], str | None], host: str, port: int,
                 api_key: str = ""):
        super().__init__(V2Servicer(path, not_ready, api_key), pb_grpc.add_GRPCInferenceServiceServicer_to_server,
                         host, port, "KServe v2 gRPC service")
