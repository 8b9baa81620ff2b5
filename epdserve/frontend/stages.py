"""What the front end needs from the stages behind it: the :class:`Stages` protocol.

Implementations: the gateway's (``gateway/stages.py``: encoders over gRPC, prefill and decode over ZeroMQ), the
prefill front's (``prefill/http_front.py``: encoders, and its own scheduler) and the decode front's
(``decode/http_front.py``: its own scheduler; it encodes nothing).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from epdserve.frontend.prompt import EncodedImage, VideoInput
from epdserve.wire.messages import DecodeRequest, PrefillRequest, TokenOutput


class Stages(Protocol):
    """The stages one front end sends its requests to. All methods run on the front's event loop.

    A request goes out with :meth:`send` (or the first step of :meth:`generate`), its outputs come from
    :meth:`generate`, and its :class:`~epdserve.frontend.lifetime.RequestLifetime` ends it with :meth:`release`.

    Attributes:
        encodes: whether images and videos go to an encoder through :meth:`encode`. False: this side needs only
            the image and video slots (which :class:`~epdserve.frontend.chat.ChatService` computes from the file
            headers), as on a decode front, whose prefill peer encodes.
        sends_before_encoded: whether an image request is sent as soon as its prompt exists, before the encoder
            answers (the gateway: prefill holds it until the embeddings land). False: it goes out in
            :meth:`generate` (a PD front binds the router's bootstrap fields after preparing).
    """

    encodes: bool
    sends_before_encoded: bool

    @property
    def ready(self) -> bool:
        """True once the stages answered their handshake."""
        ...

    @property
    def context_length(self) -> int:
        """Longest prompt + completion in tokens the stages accept."""
        ...

    @property
    def bootstrap(self) -> tuple[str, int] | None:
        """The prefill server's bootstrap (host, port) for a ``DecodeRequest``; None where each request's is named
        when it is placed (a PD router, or the gateway choosing among several prefill servers)."""
        ...

    def not_ready(self) -> str | None:
        """Why not every kind of request can be served now (``GET /health``'s 503 reason), or None."""
        ...

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None,
                     videos: Sequence[VideoInput] = ()) -> list[EncodedImage]:
        """Encode ``images`` (image file bytes) and ``videos`` for ``rid``; the embeddings go to the prefill
        server's TP ranks. One :class:`EncodedImage` per image, then per video (see
        :class:`~epdserve.frontend.encoder_client.EncoderClient`).

        Raises:
            StageError: 400 for an image or video the encoder rejects (or a side that takes none), 413 for one too
                large, 503 when no encoder (or the prefill server) is up, 504 past ``deadline``
                (``time.monotonic()`` value), 500 otherwise.
        """
        ...

    def send(self, prefill_req: PrefillRequest, decode_req: DecodeRequest) -> None:
        """Start the request at the stages now; its outputs are taken with :meth:`generate`.

        Raises:
            StageError: 503 when a stage it needs has no connection.
        """
        ...

    def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                 deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """The request's outputs up to the one with a ``finish_reason``, sending it first unless :meth:`send` did.
        Leaving early does not abort it: :meth:`release` does.

        Raises:
            StageError: 503 when a stage it needs is or goes down, 504 past ``deadline``.
        """
        ...

    def release(self, rid: str) -> None:
        """``rid`` is over at this front: forget it, and abort it at the stages unless it finished."""
        ...

    def abort(self, rid: str) -> None:
        """Tell the stages to drop whatever they hold of ``rid`` (embeddings pushed before the request was sent
        included). Synchronous: it runs in ``finally`` blocks of cancelled tasks."""
        ...

    def abort_choice(self, rid: str, index: int) -> None:
        """n > 1: choice ``index`` of ``rid`` ended here (a stop string): tell decode to stop its fork, the other
        choices running on."""
        ...

    async def close(self) -> None:
        """Close every connection."""
        ...
