"""The decode server's HTTP front (``epdserve.frontend.pd``), a child process of the server: image token counts
come from the image sizes and video layouts from the video metadata (``ChatService``'s image and video slots; no
encoder here, the prefill leg's server encodes), and
the request goes to the scheduler as a ``DecodeRequest`` with the router's bootstrap fields; its token outputs
stream back like the gateway's.

``python -m epdserve.decode.http_front CONFIG_JSON --parent-pid PID`` (see ``epdserve.frontend.process``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from epdserve.config import DecodeConfig
from epdserve.frontend.errors import StageError
from epdserve.entry.front import run_front
from epdserve.frontend.pd import SchedulerStages
from epdserve.frontend.prompt import EncodedImage, VideoInput
from epdserve.wire.messages import DecodeRequest, PrefillRequest


class DecodeFrontStages(SchedulerStages):
    """The :class:`~epdserve.frontend.stages.Stages` of a decode front: this server's scheduler only."""

    role = "decode"
    encodes = False  # the prompt needs only the image slots; embeddings are the prefill server's

    @property
    def bootstrap(self) -> None:
        """None: the router names the prefill server per request."""
        return None

    def server_info_fields(self) -> dict[str, Any]:
        """Extra ``/get_server_info`` fields: the decode batch limit (what smg's PD admission reads)."""
        return {"max_running_requests": self.config.max_running_requests}

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None,
                     videos: Sequence[VideoInput] = ()) -> list[EncodedImage]:
        """Not available here (``encodes`` is False).

        Raises:
            StageError: 400, always.
        """
        raise StageError("the decode server takes no images or videos to encode", 400)

    def leg(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> DecodeRequest:
        """The decode leg: the ``DecodeRequest``."""
        return decode_req


def main(argv: list[str] | None = None) -> int:
    """Serve the decode front until SIGTERM (see the module docstring)."""
    return run_front("decode", DecodeConfig, DecodeFrontStages, argv)


if __name__ == "__main__":
    sys.exit(main())
