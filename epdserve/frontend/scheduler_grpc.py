"""What the two scheduler gRPC protocols smg speaks to a ``grpc://`` prefill or decode worker share: SGLang's
(``sglang.grpc.scheduler.SglangScheduler``, :mod:`epdserve.frontend.sglang.service`) and TokenSpeed's
(``tokenspeed.grpc.scheduler.TokenSpeedScheduler``, :mod:`epdserve.frontend.tokenspeed.service`), both from the
``smg-grpc-proto`` package.

Their ``Generate`` streams, ``Abort``, ``HealthCheck`` and ``GetTokenizer`` have the same messages (field for field)
and the same meaning, so one request path serves both: the protocol module turns its ``GenerateRequest`` into a
:class:`~epdserve.frontend.scheduler_requests.GrpcLeg` (:meth:`SchedulerServicerBase._build`) and says how a prefill
leg's image embeddings reach this server's TP ranks (:meth:`SchedulerServicerBase._embed`: SGLang's sends image
bytes that the front's encoders encode; TokenSpeed's names encoder bootstrap rooms to pull them from); the legs,
heartbeats, aborts and outputs are here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import logging
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from functools import cached_property
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct

from epdserve.frontend.errors import StageError
from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.grpc_tensor import InvalidRequest
from epdserve.frontend.scheduler_requests import GrpcLeg, check_encoded
from epdserve.wire.messages import TokenOutput

logger = logging.getLogger("epdserve.front")

ABORTED = 499  # the StageError status that ends an aborted request's Generate
# smg gives up on a prefill leg whose stream yields nothing for 3 s ("PD prefill leg produced nothing within its
# silence bound"), as a wedged engine; encoding and prefilling images on a busy CPU take longer. The prefill leg
# therefore sends an empty GenerateResponse (neither chunk nor complete, which smg skips) every this many seconds
# until it has its answer; the scheduler's own --request-timeout-s still ends a request that never finishes.
HEARTBEAT_S = 1.0


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status of a :class:`StageError`'s HTTP status."""
    return {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.INVALID_ARGUMENT,
            503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}.get(
        status, grpc.StatusCode.INTERNAL)


@dataclasses.dataclass
class _Call:
    """A ``Generate`` in progress; ``aborted`` once ``Abort`` named it; ``embedding``: its wait for image
    embeddings, while it lasts (``Abort`` cancels it)."""

    aborted: bool = False
    embedding: asyncio.Future | None = None


# The files smg's tokenizer loader reads (smg's own servicers send this set, smg_grpc_servicer/
# tokenizer_bundle.py), exact names and patterns; plus processor_config.json, where transformers 5 checkpoints
# keep the image processor's settings.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
                    "chat_template.json", "preprocessor_config.json", "processor_config.json")
_TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja", "*.model")
_CHUNK = 64 * 1024


def tokenizer_zip(model_dir: Path) -> bytes:
    """A ZIP (deflated, flat names) of the tokenizer files in ``model_dir`` (``GetTokenizer``).

    Raises:
        FileNotFoundError: none of them is there.
    """
    names = [n for n in _TOKENIZER_FILES if (model_dir / n).is_file()]
    names += sorted({m.name for g in _TOKENIZER_GLOBS for m in model_dir.glob(g) if m.is_file()} - set(names))
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(model_dir / name, name)
    return buf.getvalue()


async def tokenizer_chunks(model_dir: Path) -> AsyncIterator[Any]:
    """``GetTokenizer``'s answer: :func:`tokenizer_zip` of ``model_dir`` (made on a worker thread) as
    ``GetTokenizerChunk`` s of 64 KiB, the last with the archive's SHA-256.

    Raises:
        FileNotFoundError: no tokenizer files there.
    """
    from smg_grpc_proto.generated import common_pb2

    data = await asyncio.to_thread(tokenizer_zip, model_dir)
    digest = hashlib.sha256(data).hexdigest()
    for start in range(0, len(data), _CHUNK):
        last = start + _CHUNK >= len(data)
        yield common_pb2.GetTokenizerChunk(data=data[start:start + _CHUNK], sha256=digest if last else "")


class SchedulerServicerBase:
    """The protocol-independent RPCs of one front's scheduler service (see the module docstring). A protocol
    subclass sets ``pb`` (its generated ``*_pb2`` module) and implements :meth:`_build` and :meth:`_embed`, and
    the info RPCs whose messages differ.

    Args:
        front: a prefill or decode front (``epdserve.frontend.pd.Front``; not imported: pd starts this server).
        config: its server's config (``PrefillConfig`` or ``DecodeConfig``).
        pb: the protocol's generated message module.
    """

    def __init__(self, front: Any, config: Any, pb: Any) -> None:
        self.front, self.config, self.pb = front, config, pb
        self.calls: dict[str, _Call] = {}
        self.started = time.time()

    @cached_property
    def model(self):
        """The checkpoint's :class:`~epdserve.models.config.ModelConfig` (read once)."""
        from epdserve.models.config import ModelConfig

        return ModelConfig.load(self.front.model_path)

    async def _build(self, request: Any, rid: str) -> GrpcLeg:
        """Both stage requests of ``request`` (the protocol's ``GenerateRequest``) for this front's role.

        Raises:
            InvalidRequest: the request is malformed or asks for something the stages do not do.
        """
        raise NotImplementedError

    def _has_images(self, leg: GrpcLeg) -> bool:
        """Whether this leg must have image embeddings sent to the scheduler before its outputs come."""
        raise NotImplementedError

    async def _embed(self, rid: str, leg: GrpcLeg) -> list[EncodedImage]:
        """Have the embeddings of the leg's images sent to this server's TP ranks; one result per image span.

        Raises:
            StageError: as ``Stages.encode``.
        """
        raise NotImplementedError

    async def Generate(self, request, context) -> AsyncIterator[Any]:
        """One leg of a PD request; its end, however it comes, frees it."""
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        await self._ready(context)
        if rid in self.calls or rid in self.front.stages.scheduler.routes:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is in progress")
        try:
            leg = await self._build(request, rid)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._has_images(leg) and (why := self.front.not_ready()) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)  # a prefill front without an encoder
        call = self.calls[rid] = _Call()
        done = False
        try:
            # Answer the call's headers now: grpc.aio holds them until the first response, while smg bounds the
            # time until a leg's stream opens (3 s: "prefill leg produced nothing within 3.0s of its dispatch"),
            # and a prefill of images under load takes longer than that.
            await context.send_initial_metadata(())
            async for item in self._legs(rid, leg, call):
                if isinstance(item, tuple):
                    await context.abort(*item)
                yield item
            done = True
        finally:
            # Cancelled (smg dropped the stream), aborted, failed or done: nothing stays at the scheduler.
            self.calls.pop(rid, None)
            if not done or call.aborted:
                self.front.stages.scheduler.drop(rid)
                self.front.stages.abort(rid)

    async def _legs(self, rid: str, leg: GrpcLeg, call: _Call) -> AsyncIterator[Any]:
        """The responses of one leg, or a ``(code, message)`` tuple to abort the call with."""
        ids, last = [], None
        beat = HEARTBEAT_S if self.front.role == "prefill" else None
        try:
            if self._has_images(leg):
                encoding = call.embedding = asyncio.ensure_future(self._embed(rid, leg))
                try:
                    while not (await asyncio.wait({encoding}, timeout=beat))[0]:
                        yield self.pb.GenerateResponse(request_id=rid)
                    if call.aborted:
                        raise StageError("aborted", ABORTED)
                    check_encoded(leg.prefill.images, encoding.result())
                finally:
                    encoding.cancel()
                    call.embedding = None
            if call.aborted:
                raise StageError("aborted", ABORTED)
            async for out in self._outputs(rid, leg, beat):
                if out is None:
                    yield self.pb.GenerateResponse(request_id=rid)
                    continue
                if out.finish_reason == "error":
                    yield grpc.StatusCode.INTERNAL, out.error or "generation failed"
                    return
                ids += out.token_ids
                last = out
                if leg.stream:
                    yield self._chunk(rid, out)
        except InvalidRequest as e:
            yield grpc.StatusCode.INVALID_ARGUMENT, str(e)
            return
        except StageError as e:
            if e.status != ABORTED:
                yield grpc_code(e.status), e.message
                return
            last = TokenOutput(rid, [], "abort", len(leg.prefill.input_ids), len(ids))
        yield self._complete(rid, ids, last)

    async def _outputs(self, rid: str, leg: GrpcLeg, beat: float | None) -> AsyncIterator[TokenOutput | None]:
        """This leg's scheduler outputs, sending it first, up to the one with a finish reason; None whenever
        ``beat`` seconds pass without one (None: wait as long as it takes).

        Raises:
            StageError: the request ended on a stage error, or was aborted (status 499).
        """
        scheduler = self.front.stages.scheduler
        self.front.stages.send(leg.prefill, leg.decode)
        route = scheduler.routes[rid]
        while True:
            try:
                out = await route.take(beat)
            except TimeoutError:
                yield None
                continue
            if out.finish_reason is not None:
                scheduler.routes.pop(rid, None)
                yield out
                return
            yield out

    def _chunk(self, rid: str, out: TokenOutput) -> Any:
        return self.pb.GenerateResponse(request_id=rid, chunk=self.pb.GenerateStreamChunk(
            token_ids=out.token_ids, prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens, output_logprobs=self._logprobs(out.token_ids, out.logprobs)))

    def _complete(self, rid: str, ids: list[int], last: TokenOutput) -> Any:
        matched = {"matched_token_id": ids[-1]} if last.finish_reason == "stop" and ids else {}
        return self.pb.GenerateResponse(request_id=rid, complete=self.pb.GenerateComplete(
            output_ids=ids, finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens, cached_tokens=last.cached_tokens, **matched))

    def _logprobs(self, ids: list[int], logprobs: list) -> Any:
        if not logprobs:
            return None
        return self.pb.OutputLogProbs(token_logprobs=[lp.logprob for lp in logprobs], token_ids=ids, top_logprobs=[
            self.pb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top]) for lp in logprobs])

    async def Abort(self, request, context) -> Any:
        """End the named ``Generate`` with ``finish_reason`` "abort" (success False for an unknown id)."""
        call = self.calls.get(request.request_id)
        if call is None:
            return self.pb.AbortResponse(success=False, message=f"request {request.request_id} not found")
        call.aborted = True
        if call.embedding is not None:  # still waiting for its images: stop (a claim gives its room up)
            call.embedding.cancel()
        route = self.front.stages.scheduler.routes.get(request.request_id)
        if route is not None:
            route.put(StageError(request.reason or "aborted", ABORTED))
        return self.pb.AbortResponse(success=True, message=f"request {request.request_id} aborted")

    async def HealthCheck(self, request, context) -> Any:
        """Healthy once the front is ready and its scheduler answers a load query within 5 s."""
        if (why := self.front.not_ready()) is not None:
            return self.pb.HealthCheckResponse(healthy=False, message=why)
        try:
            await self.front.stages.scheduler.load(timeout_s=5.0)
        except TimeoutError:
            return self.pb.HealthCheckResponse(healthy=False, message="the scheduler did not answer within 5 s")
        return self.pb.HealthCheckResponse(healthy=True, message="ok")

    async def _ready(self, context) -> None:
        if not self.front.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.front.not_ready() or "the server is starting")

    def model_info_fields(self) -> dict[str, Any]:
        """The ``GetModelInfoResponse`` fields both protocols name alike: the checkpoint smg tokenizes for (its
        tokenizer is the model directory) and its limits."""
        m, tok = self.model, self.front.chat.builder.tokenizer
        archs = getattr(self.front.chat.builder.model_config, "architectures", None) or []
        context_length = self.front.stages.context_length
        return dict(model_path=self.front.model_path, tokenizer_path=self.front.model_path,
                    served_model_name=self.front.model_name, max_context_length=context_length,
                    vocab_size=m.vocab_size, supports_vision=True, model_type=m.model_type,
                    eos_token_ids=list(m.eos_token_ids), pad_token_id=tok.pad_token_id or 0,
                    bos_token_id=tok.bos_token_id or 0, max_req_input_len=context_length - 1,
                    architectures=list(archs))

    def server_info_extra(self, version: str) -> dict[str, Any]:
        """This protocol's own ``GetServerInfoResponse`` fields (its version field's name, ...)."""
        raise NotImplementedError

    async def GetServerInfo(self, request, context) -> Any:
        """SGLang-named ``server_args`` (the keys smg reads) and the KV capacity in tokens."""
        await self._ready(context)
        from epdserve import __version__

        args, sched = Struct(), Struct()
        args.update(self.server_args())
        info = self.front.stages.scheduler.info
        sched.update({"max_total_num_tokens": info.num_pages * info.page_size, "is_generation": True})
        return self.pb.GetServerInfoResponse(
            server_args=args, scheduler_info=sched, active_requests=len(self.calls),
            uptime_seconds=time.time() - self.started, max_total_num_tokens=info.num_pages * info.page_size,
            **self.server_info_extra(f"epdserve-{__version__}"))

    def server_args(self) -> dict[str, Any]:
        """SGLang-named server arguments (the keys smg reads from ``GetServerInfo.server_args``)."""
        info, c = self.front.stages.scheduler.info, self.config
        args = {"model_path": self.front.model_path, "tokenizer_path": self.front.model_path,
                "served_model_name": self.front.model_name, "disaggregation_mode": self.front.role, "tp_size": c.tp,
                "dp_size": 1, "pp_size": 1, "context_length": info.context_length, "page_size": info.page_size,
                "max_total_tokens": info.num_pages * info.page_size, "is_embedding": False,
                "vocab_size": self.model.vocab_size, "grpc_port": c.grpc_port, "port": c.port}
        if self.front.role == "prefill":
            args["disaggregation_bootstrap_port"] = c.bootstrap_port
        else:
            args["max_running_requests"] = c.max_running_requests
        return args

    async def scheduler_load(self, context) -> Any:
        """The protocol's ``SchedulerLoad`` of this server as one DP rank (smg's fallback when no KV events
        flow); evictable radix-cache pages are not load (as ``/loads``)."""
        await self._ready(context)
        try:
            load = await self.front.stages.scheduler.load()
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler did not answer")
        page_size = self.front.stages.scheduler.info.page_size
        busy = load.kv_pages_used - load.kv_pages_cached
        return self.pb.SchedulerLoad(
            num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
            num_total_reqs=load.num_running_reqs + load.num_waiting_reqs, num_used_tokens=busy * page_size,
            max_total_num_tokens=load.kv_pages_total * page_size,
            token_usage=busy / load.kv_pages_total if load.kv_pages_total else 0.0,
            max_running_requests=getattr(self.config, "max_running_requests", 0))

    def loads_response(self, sched: Any) -> Any:
        """``GetLoadsResponse`` of one rank's ``sched``."""
        return self.pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), dp_rank_count=1, loads=[sched],
            aggregate=self.pb.AggregateMetrics(total_running_reqs=sched.num_running_reqs,
                                               total_waiting_reqs=sched.num_waiting_reqs,
                                               total_reqs=sched.num_total_reqs, avg_token_usage=sched.token_usage))

    async def GetTokenizer(self, request, context) -> AsyncIterator[Any]:
        """The checkpoint's tokenizer, chat template and processor files (:func:`tokenizer_chunks`): how smg gets a
        tokenizer where the model directory is not on its machine."""
        async for chunk in tokenizer_chunks(Path(self.front.model_path)):
            yield chunk

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[Any]:
        """UNIMPLEMENTED: the radix cache publishes no events."""
        # smg asks every worker; UNIMPLEMENTED turns its cache-event subscription off (the generated base
        # raises NotImplementedError instead, which grpc logs as a servicer failure on every worker start).
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events are not published")
        yield  # an async generator, as the streaming RPC needs
