"""TokenSpeed's scheduler gRPC service (``tokenspeed.grpc.scheduler.TokenSpeedScheduler``, smg-grpc-proto) on a
prefill or decode front's ``--grpc-port`` with ``--grpc-protocol tokenspeed``: the worker protocol of smg's
``--epd-disaggregation`` mode (smg 1.13 runs EPD with TokenSpeed workers only; docs/architecture.md, "smg's own EPD
mode").

The request path is SGLang's (:mod:`epdserve.frontend.scheduler_grpc`): PD dual dispatch with the room of
``kv_bootstrap_info``, the prefill leg answering its first token (with heartbeats), the decode leg streaming.
What differs is where a prefill leg's image embeddings come from: smg has already sent each image's pixels to an
encode worker it picked (``TokenSpeedEncoder/Encode``, one bootstrap room per image) and names that worker's
bootstrap address and room in ``encode_bootstrap_info``; the front claims each room
(:class:`~epdserve.frontend.tokenspeed.room_client.RoomClient`), and the encoder pushes the embedding to this
server's TP ranks exactly as it does for a request of epdserve's own gateway, under smg's content hash of the image.

RPCs: ``Generate``, ``Abort``, ``HealthCheck``, ``GetTokenizer`` (shared), ``GetModelInfo`` (TokenSpeed's fields,
``multimodal_encoder_dtype`` telling smg the pixel dtype to send), ``GetServerInfo``, ``GetLoads``;
``SubscribeKvEvents``, ``FlushCache`` and the profiler: UNIMPLEMENTED.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any


from epdserve.frontend.grpc_service import GrpcService
from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.scheduler_grpc import SchedulerServicerBase
from epdserve.frontend.scheduler_requests import GrpcLeg
from epdserve.frontend.tokenspeed.items import ProcessorLimits
from epdserve.frontend.tokenspeed.requests import build_leg
from epdserve.frontend.tokenspeed.room_client import RoomClient

_IMAGE = 1  # smg.grpc.common.Modality.IMAGE


def _servicer_base() -> type:
    """The generated servicer base class (imported late: ``smg-grpc-proto`` is the ``smg-grpc`` extra)."""
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc

    return tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer


def dtype_name(dtype: str, device: str) -> str:
    """The torch dtype name a ``--dtype`` flag resolves to (``auto``: bfloat16 on CUDA, float32 on the CPU)."""
    if dtype != "auto":
        return dtype
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if cuda else "float32"


class TokenSpeedSchedulerServicer(SchedulerServicerBase):
    """The ``TokenSpeedScheduler`` RPCs of one front (see the module docstring); :func:`make_servicer` mixes in
    the generated base class.

    Args:
        front: a prefill or decode front (``epdserve.frontend.pd.Front``).
        config: its server's config (``PrefillConfig`` or ``DecodeConfig``; ``request_timeout_s`` bounds the wait
            for an image's encode).
    """

    def __init__(self, front: Any, config: Any) -> None:
        from smg_grpc_proto.generated import tokenspeed_scheduler_pb2

        super().__init__(front, config, tokenspeed_scheduler_pb2)
        self.rooms = RoomClient()

    @cached_property
    def limits(self) -> ProcessorLimits:
        """This checkpoint's image-processor limits (read once the front's processor is loaded)."""
        builder = self.front.chat.builder
        return ProcessorLimits.of(builder.processor.image_processor, builder.image_token_id)

    async def _build(self, request: Any, rid: str) -> GrpcLeg:
        return await build_leg(request, rid, self.front.role, context_length=self.front.stages.context_length,
                               vocab_size=self.model.vocab_size, limits=self.limits)

    def _has_images(self, leg: GrpcLeg) -> bool:
        return bool(leg.rooms)

    async def _embed(self, rid: str, leg: GrpcLeg) -> list[EncodedImage]:
        """Claim every image's encoder room for this server's TP ranks (waiting up to ``--request-timeout-s`` for
        its encode)."""
        info = self.front.stages.scheduler.info
        hashes = [leg.prefill.images[r.span].image_hash for r in leg.rooms]
        return await self.rooms.claim_all(rid, leg.rooms, hashes, list(info.embed_endpoints), info.embed_host_id,
                                          self.config.request_timeout_s)

    async def GetModelInfo(self, request, context) -> Any:
        """The checkpoint smg tokenizes for, its limits, and that it takes images (pixels in the tower's dtype)."""
        await self._ready(context)
        dtype = dtype_name(self.config.dtype, self.config.device)
        return self.pb.GetModelInfoResponse(**self.model_info_fields(), supports_multimodal=True,
                                            supported_modalities=[_IMAGE], model_dtype=dtype,
                                            multimodal_encoder_dtype=dtype)

    def server_info_extra(self, version: str) -> dict[str, Any]:
        return {"tokenspeed_version": version}

    async def GetLoads(self, request, context) -> Any:
        """The scheduler's load as one DP rank."""
        return self.loads_response(await self.scheduler_load(context))

    def close(self) -> None:
        """Close the encoder bootstrap sockets."""
        self.rooms.close()


def make_servicer(front: Any, config: Any) -> Any:
    """A :class:`TokenSpeedSchedulerServicer` with the generated servicer base mixed in.

    Raises:
        ImportError: ``smg-grpc-proto`` is not installed (``pip install 'epdserve[smg-grpc]'``).
    """
    cls = type("TokenSpeedSchedulerServicer", (TokenSpeedSchedulerServicer, _servicer_base()), {})
    return cls(front, config)


class TokenSpeedGrpcServer(GrpcService):
    """The ``TokenSpeedScheduler`` gRPC server of one front on ``host``:``port`` (a front service).

    Raises:
        ImportError: (construction) ``smg-grpc-proto`` is not installed.
    """

    def __init__(self, front: Any, config: Any, host: str, port: int):
        from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc

        super().__init__(make_servicer(front, config),
                         tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server, host, port,
                         "TokenSpeed scheduler gRPC service (smg --epd-disaggregation grpc:// worker)")

    async def stop(self) -> None:
        """Stop serving, then close the encoder bootstrap sockets."""
        await super().stop()
        self.servicer.close()
