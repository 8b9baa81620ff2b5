"""The prefill server's side of its HTTP front (``epdserve.gateway.pd_front``): images go to the encoders of
``--encoder-urls`` (content-hash routing and failover, ``EncoderPool``) with this server's TP-rank embedding
endpoints as targets, and the prompt goes to the scheduler as ``PrefillRequest(reply=True)``; the scheduler's one
reply (first token or error) ends the leg."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from epdserve.config import PrefillConfig
from epdserve.gateway.pd_front import FrontStages, SchedulerClient
from epdserve.gateway.prompt import EncodedImage, PromptBuilder
from epdserve.gateway.stages import EncoderClient, StageError
from epdserve.wire.messages import DecodeRequest, PrefillRequest, ServerInfo, TokenOutput


class PrefillFrontStages(FrontStages):
    """The ``stages`` of a prefill front's ``ChatService`` (see ``epdserve.gateway.pd_front.FrontStages``).

    Args:
        config: the prefill server's config (``encoder_urls``, ``bootstrap_port``).
        scheduler: the client of this server's scheduler socket.
        encoder: an encoder client to use instead of gRPC to ``config.encoder_urls`` (tests).
    """

    role = "prefill"

    def __init__(self, config: PrefillConfig, scheduler: SchedulerClient, encoder: EncoderClient | None = None):
        self.config = config
        self.scheduler = scheduler
        self.encoder = encoder

    @property
    def ready(self) -> bool:
        return self.scheduler.info is not None

    @property
    def context_length(self) -> int:
        return self.scheduler.info.context_length

    @property
    def prefill_info(self) -> ServerInfo:
        return self.scheduler.info

    def server_info_fields(self) -> dict[str, Any]:
        """Extra ``/get_server_info`` fields: the bootstrap port (SGLang's name) and the encoders."""
        return {"disaggregation_bootstrap_port": self.config.bootstrap_port,
                "encoder_urls": [a for a in self.config.encoder_urls.split(",") if a.strip()]}

    async def start(self, builder: PromptBuilder) -> None:
        """Handshake with the scheduler; connect to the encoders in the background (text needs none)."""
        await self.scheduler.start()
        if self.encoder is None and self.config.encoder_urls.strip():
            from epdserve.gateway.encoders import EncoderPool, parse_encoder_addrs
            from epdserve.gateway.stages import GrpcEncoderClient

            pool = EncoderPool([GrpcEncoderClient(a) for a in parse_encoder_addrs(self.config.encoder_urls)])
            self.encoder = pool
            pool.start(600.0)

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None) -> list[EncodedImage]:
        """Encode ``images``; the embeddings go to every TP rank of this server.

        Raises:
            StageError: 400 when no ``--encoder-urls`` were given; else the encoder's (see ``EncoderClient``).
        """
        if self.encoder is None:
            raise StageError("this prefill server has no --encoder-urls, so it cannot take images", 400)
        return await self.encoder.encode(rid, images, list(self.scheduler.info.embed_endpoints))

    def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                 deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Run the prefill leg: one output, the first token (``finish_reason="length"``) or an error."""
        return self.scheduler.run(prefill_req)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.close()
        await self.scheduler.close()
