"""The prefill server's HTTP front (``epdserve.frontend.pd``), a child process of the server: images and videos go
to the encoders of ``--encoder-urls`` (content-hash routing and failover, ``EncoderPool``) with this server's TP-rank
embedding endpoints as targets, and the prompt goes to the scheduler as ``PrefillRequest(reply=True)``; the
scheduler's one reply (first token or error) ends the leg.

``python -m epdserve.prefill.http_front CONFIG_JSON --parent-pid PID`` (see ``epdserve.frontend.process``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from epdserve.config import PrefillConfig
from epdserve.frontend.encoder_client import EncoderClient, GrpcEncoderClient, encode_options
from epdserve.frontend.encoders import EncoderPool, parse_encoder_addrs
from epdserve.frontend.errors import StageError
from epdserve.entry.front import run_front
from epdserve.frontend.pd import SchedulerStages
from epdserve.frontend.prompt import EncodedImage, VideoInput
from epdserve.frontend.scheduler_client import SchedulerClient
from epdserve.wire.messages import DecodeRequest, PrefillRequest


class PrefillFrontStages(SchedulerStages):
    """The :class:`~epdserve.frontend.stages.Stages` of a prefill front: the encoders and this server's scheduler.

    Args:
        config: the prefill server's config (``encoder_urls``, ``bootstrap_port``).
        scheduler: the client of this server's scheduler socket.
        encoder: an encoder client to use instead of gRPC to ``config.encoder_urls`` (tests).
    """

    role = "prefill"
    encodes = True  # without --encoder-urls, encode refuses images (400)

    def __init__(self, config: PrefillConfig, scheduler: SchedulerClient, encoder: EncoderClient | None = None):
        super().__init__(config, scheduler)
        self.encoder = encoder

    @property
    def bootstrap(self) -> tuple[str, int]:
        """This server's own bootstrap address (the router's fields replace it in the request)."""
        return self.scheduler.info.bootstrap_host, self.scheduler.info.bootstrap_port

    def not_ready(self) -> str | None:
        """Why images cannot be taken now (no encoder of ``--encoder-urls`` serving), or None."""
        not_serving = getattr(self.encoder, "not_serving", None)
        return not_serving() if not_serving is not None else None

    def server_info_fields(self) -> dict[str, Any]:
        """Extra ``/get_server_info`` fields: the bootstrap port (SGLang's name) and the encoders."""
        return {"disaggregation_bootstrap_port": self.config.bootstrap_port,
                "encoder_urls": [a for a in self.config.encoder_urls.split(",") if a.strip()]}

    async def start(self) -> None:
        """Handshake with the scheduler; connect to the encoders in the background (text needs none)."""
        await super().start()
        if self.encoder is None and self.config.encoder_urls.strip():
            pool = EncoderPool([GrpcEncoderClient(a) for a in parse_encoder_addrs(self.config.encoder_urls)])
            self.encoder = pool
            pool.start(600.0)

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None,
                     videos: Sequence[VideoInput] = ()) -> list[EncodedImage]:
        """Encode ``images`` and ``videos``; the embeddings go to every TP rank of this server.

        Raises:
            StageError: 400 when no ``--encoder-urls`` were given; else the encoder's (see ``EncoderClient``).
        """
        if self.encoder is None:
            raise StageError("this prefill server has no --encoder-urls, so it cannot take images or videos", 400)
        info = self.scheduler.info
        return await self.encoder.encode(rid, images, list(info.embed_endpoints),
                                         **encode_options(videos, info.embed_host_id))

    def leg(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> PrefillRequest:
        """The prefill leg: the ``PrefillRequest``."""
        return prefill_req

    async def close(self) -> None:
        """Close the encoder channels and the scheduler connection."""
        if self.encoder is not None:
            await self.encoder.close()
        await super().close()


def main(argv: list[str] | None = None) -> int:
    """Serve the prefill front until SIGTERM (see the module docstring)."""
    return run_front("prefill", PrefillConfig, PrefillFrontStages, argv)


if __name__ == "__main__":
    sys.exit(main())
