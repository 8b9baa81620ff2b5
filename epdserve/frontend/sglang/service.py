"""SGLang's scheduler gRPC service (``sglang.grpc.scheduler.SglangScheduler``, the schema of the ``smg-grpc-proto``
package) on a prefill or decode front's ``--grpc-port``: what smg talks to a ``grpc://`` worker, and what SGLang's
``--grpc-mode`` serves (``--grpc-protocol sglang``, the default).

smg does the OpenAI API, chat templates, tokenization, stop strings, tool and reasoning parsing and image fetching
itself, and sends each request to one prefill and one decode worker at once (PD dual dispatch) as a
``GenerateRequest`` of token ids with ``disaggregated_params`` (the prefill server's bootstrap host and port, and
a random room): the same legs, room semantics and scheduler path as the HTTP fronts
(:mod:`epdserve.frontend.pd`), only without the template step. Conversion and checks are
:mod:`epdserve.frontend.sglang.requests`.

RPCs:
- ``Generate`` (server-streaming): prefill leg: encodes the images (on the prefill front's encoders), prefills and
  answers the first token (``finish_reason`` "length"); decode leg: the tokens as they come, one
  ``GenerateStreamChunk`` per scheduler output and a ``GenerateComplete`` when ``stream``, else one
  ``GenerateComplete`` with every output id. Bad input: INVALID_ARGUMENT; not ready or a stage down: UNAVAILABLE.
- ``Abort``: ends that request's ``Generate`` with ``finish_reason`` "abort" and frees its KV pages and room at the
  scheduler; a cancelled ``Generate`` (smg dropped the stream: client gone, stop string matched) does the same.
- ``HealthCheck``: healthy once the front is ready and the scheduler answers a load query.
- ``GetModelInfo``, ``GetServerInfo`` (``server_args`` has the keys smg reads: ``disaggregation_mode``,
  ``tokenizer_path``, ``context_length``, ``max_running_requests``, ...), ``GetLoads``.
- ``GetTokenizer``: the tokenizer files as a ZIP (for an smg without the model directory).
- ``Embed`` and the rest: UNIMPLEMENTED.
"""

from __future__ import annotations

from typing import Any

import grpc

from epdserve.frontend.grpc_service import GrpcService
from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.scheduler_grpc import SchedulerServicerBase
from epdserve.frontend.scheduler_requests import GrpcLeg
from epdserve.frontend.sglang.requests import build_leg


def _servicer_base() -> type:
    """The generated servicer base class (imported late: ``smg-grpc-proto`` is the ``smg-grpc`` extra)."""
    from smg_grpc_proto import sglang_scheduler_pb2_grpc

    return sglang_scheduler_pb2_grpc.SglangSchedulerServicer


class SglangSchedulerServicer(SchedulerServicerBase):
    """The ``SglangScheduler`` RPCs of one front (see the module docstring; the shared ones are
    :class:`~epdserve.frontend.scheduler_grpc.SchedulerServicerBase`'s); :func:`make_servicer` mixes in the
    generated base class, which answers UNIMPLEMENTED for the RPCs not here.

    Args:
        front: a prefill or decode front (``epdserve.frontend.pd.Front``; not imported: pd starts this server).
        config: its server's config (``PrefillConfig`` or ``DecodeConfig``).
    """

    def __init__(self, front: Any, config: Any) -> None:
        from smg_grpc_proto import sglang_scheduler_pb2

        super().__init__(front, config, sglang_scheduler_pb2)

    async def _build(self, request: Any, rid: str) -> GrpcLeg:
        builder = self.front.chat.builder
        return await build_leg(request, rid, self.front.role, context_length=self.front.stages.context_length,
                               vocab_size=self.model.vocab_size, image_token_id=builder.image_token_id,
                               image_processor=builder.processor.image_processor)

    def _has_images(self, leg: GrpcLeg) -> bool:
        return bool(leg.image_data)

    async def _embed(self, rid: str, leg: GrpcLeg) -> list[EncodedImage]:
        """The image files go to the front's encoders (``--encoder-urls``), which push to the TP ranks."""
        return await self.front.stages.encode(rid, leg.image_data)

    async def GetModelInfo(self, request, context) -> Any:
        """The checkpoint smg tokenizes for (its tokenizer is the model directory) and its limits."""
        await self._ready(context)
        return self.pb.GetModelInfoResponse(**self.model_info_fields(), is_generation=True)

    def server_info_extra(self, version: str) -> dict[str, Any]:
        return {"sglang_version": version, "server_type": "grpc"}

    async def GetLoads(self, request, context) -> Any:
        """The scheduler's load as one DP rank (smg's fallback when no KV events flow)."""
        sched = await self.scheduler_load(context)
        sched.disaggregation.mode = self.front.role
        return self.loads_response(sched)

    async def Embed(self, request, context) -> Any:
        """UNIMPLEMENTED: a generation model."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "epdserve serves generation only, no embeddings")


def make_servicer(front: Any, config: Any) -> Any:
    """A :class:`SglangSchedulerServicer` for ``front`` and ``config`` with the generated servicer base mixed in.

    Raises:
        ImportError: ``smg-grpc-proto`` is not installed (``pip install 'epdserve[smg-grpc]'``).
    """
    cls = type("SglangSchedulerServicer", (SglangSchedulerServicer, _servicer_base()), {})
    return cls(front, config)


class SglangGrpcServer(GrpcService):
    """The ``SglangScheduler`` gRPC server of one front on ``host``:``port`` (a front service: :meth:`start`
    before the model loads, :meth:`stop` on shutdown).

    Raises:
        ImportError: (construction) ``smg-grpc-proto`` is not installed.
    """

    def __init__(self, front: Any, config: Any, host: str, port: int):
        from smg_grpc_proto import sglang_scheduler_pb2_grpc

        super().__init__(make_servicer(front, config), sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server,
                         host, port, "SGLang scheduler gRPC service (smg grpc:// worker)")
