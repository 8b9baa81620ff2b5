"""The decode server's side of its HTTP front (``epdserve.gateway.pd_front``): image token counts come from the
image sizes (``epdserve.gateway.image_slots``, no vision tower), and the request goes to the scheduler as a
``DecodeRequest`` with the router's bootstrap fields; its token outputs stream back like the gateway's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from epdserve.config import DecodeConfig
from epdserve.gateway.image_slots import image_slots
from epdserve.gateway.media import run_cpu_bound
from epdserve.gateway.pd_front import FrontStages, SchedulerClient
from epdserve.gateway.prompt import EncodedImage, PromptBuilder
from epdserve.wire.messages import DecodeRequest, PrefillRequest, ServerInfo, TokenOutput

# ChatService reads the bootstrap address from prefill_info; the router's fields replace it (pd_front.bind_room).
_NO_PREFILL = ServerInfo(role="prefill", model_path="", context_length=0, page_size=0, num_pages=0)


class DecodeFrontStages(FrontStages):
    """The ``stages`` of a decode front's ``ChatService`` (see ``epdserve.gateway.pd_front.FrontStages``)."""

    role = "decode"

    def __init__(self, config: DecodeConfig, scheduler: SchedulerClient):
        self.config = config
        self.scheduler = scheduler
        self._image_processor = None
        # rid -> (since, first output, the started leg's outputs after it), from first_output to generate
        self._primed: dict[str, tuple[float, TokenOutput, AsyncIterator[TokenOutput]]] = {}
        self._closing: set[asyncio.Task] = set()

    @property
    def ready(self) -> bool:
        return self.scheduler.info is not None and self._image_processor is not None

    @property
    def context_length(self) -> int:
        return self.scheduler.info.context_length

    @property
    def prefill_info(self) -> ServerInfo:
        return _NO_PREFILL

    def server_info_fields(self) -> dict[str, Any]:
        """Extra ``/get_server_info`` fields: the decode batch limit (what smg's PD admission reads)."""
        return {"max_running_requests": self.config.max_running_requests}

    async def start(self, builder: PromptBuilder) -> None:
        self._image_processor = builder.processor.image_processor
        await self.scheduler.start()

    async def encode(self, rid: str, images: list[bytes], deadline: float | None = None) -> list[EncodedImage]:
        """Each image's token count and grid from its size (what the prefill side's encoder reports).

        Raises:
            StageError: 400 for an image that cannot be read (see :func:`image_slots`).
        """
        return [await run_cpu_bound(len(b), image_slots, self._image_processor, b) for b in images]

    async def first_output(self, decode_req: DecodeRequest) -> TokenOutput:
        """Start the decode leg and wait for its first output (the first token, or an error).

        A stream answered only then keeps its HTTP status open until the KV has arrived: a failure before the first
        token (this server dying, the prefill leg failing or timing out, a tokenization mismatch) is an HTTP error
        that a router retries, not a broken stream. The started leg is handed to :meth:`generate` for the same
        ``rid``, which yields this first output again.
        """
        self._drop_stale()
        outputs = self.scheduler.run(decode_req)
        try:
            first = await anext(outputs)
        except BaseException:
            await outputs.aclose()
            raise
        self._primed[decode_req.rid] = (time.monotonic(), first, outputs)
        return first

    def discard(self, rid: str) -> None:
        """Drop the leg :meth:`first_output` started for ``rid`` (aborting it unless it finished)."""
        primed = self._primed.pop(rid, None)
        if primed is not None:
            task = asyncio.get_running_loop().create_task(primed[2].aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _drop_stale(self, max_age_s: float = 30.0) -> None:
        # A leg started by first_output whose stream never began (the client left in between).
        now = time.monotonic()
        for rid in [rid for rid, (since, _, _) in self._primed.items() if now - since > max_age_s]:
            self.discard(rid)

    def generate(self, prefill_req: PrefillRequest, decode_req: DecodeRequest,
                 deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Run the decode leg (or take over the one :meth:`first_output` started): its outputs until one has a
        ``finish_reason``."""
        primed = self._primed.pop(decode_req.rid, None)
        return _prepend(primed[1], primed[2]) if primed is not None else self.scheduler.run(decode_req)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    async def close(self) -> None:
        for rid in list(self._primed):
            self.discard(rid)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=1.0)
        await self.scheduler.close()


async def _prepend(first: TokenOutput, rest: AsyncIterator[TokenOutput]) -> AsyncIterator[TokenOutput]:
    """Yield ``first``, then ``rest`` unless ``first`` already finished the request; closing this closes ``rest``
    (which aborts an unfinished request)."""
    try:
        yield first
        if first.finish_reason is None:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()
