"""The gateway's state: :class:`Gateway` holds its config, stages, chat service, metrics, request ids and admission
control."""

from __future__ import annotations

import asyncio
import logging

import httpx

from epdserve.config import GatewayConfig
from epdserve.frontend.admission import Admission
from epdserve.frontend.chat import ChatService
from epdserve.frontend.media import MediaPolicy
from epdserve.video import VideoLimits
from epdserve.frontend.observability import RequestIds
from epdserve.frontend.prompt import PromptBuilder
from epdserve.gateway.stages import GatewayStages
from epdserve.metrics import GatewayMetrics
from epdserve.models.paths import resolve_model_path

logger = logging.getLogger("epdserve.gateway")


class Gateway:
    """Everything one gateway app holds: config, stage connections and (once started) the chat service.

    Lives in ``app.state.server``. ``ready`` is True once :meth:`start` has finished.
    """

    def __init__(self, config: GatewayConfig, stages: GatewayStages | None = None,
                 startup_timeout_s: float = 300.0):
        self.config = config
        self.model_path = resolve_model_path(config.model_path)
        self.model_name = config.served_model_name or self.model_path
        self.stages = stages if stages is not None else GatewayStages(config)
        self.startup_timeout_s = startup_timeout_s
        self.chat: ChatService | None = None
        self.startup_error: BaseException | None = None
        self._http: httpx.AsyncClient | None = None
        self.metrics = GatewayMetrics()
        self.requests = RequestIds(self.metrics)
        self.admission = Admission(config.max_inflight_requests, config.max_queued_requests, config.queue_timeout_s)
        # More listeners of this gateway (the KServe v2 gRPC service), each with ``start()`` and ``stop()``: started
        # first, so they answer liveness while the stages load.
        self.services: list = []

    @property
    def ready(self) -> bool:
        """True once the processor is loaded and the stages answered."""
        return self.chat is not None and self.stages.ready

    def max_model_len(self) -> int | None:
        """The stages' context length once ready, else None."""
        return self.stages.context_length if self.ready else None

    async def start(self) -> None:
        """Load the processor and handshake with the stages; failures are logged and kept in ``startup_error``."""
        try:
            for service in self.services:
                await service.start()
            builder = await asyncio.to_thread(PromptBuilder.from_pretrained, self.model_path)
            await self.stages.start(self.startup_timeout_s)
            for info in self.stages.infos():
                if info.model_path and info.model_path != self.model_path:
                    logger.warning("the %s server serves %s, the gateway tokenizes with %s", info.role,
                                   info.model_path, self.model_path)
            if self.config.allow_remote_images:
                self._http = httpx.AsyncClient(follow_redirects=True)
            media = MediaPolicy(max_bytes=self.config.max_image_bytes, allow_remote=self.config.allow_remote_images,
                                local_root=self.config.allowed_local_media_path,
                                max_video_bytes=self.config.max_video_bytes)
            limits = VideoLimits(self.config.max_video_frames, self.config.max_video_duration_s)
            self.chat = ChatService(self.stages, builder, self.model_name, media, self.config.max_tokens_default,
                                    self._http, self.metrics, limits, self.config.max_n)
        except Exception as e:
            self.startup_error = e
            logger.error("gateway startup failed: %s", e)

    async def close(self) -> None:
        """Stop the other listeners and the tokenizer thread, close the stages and the image-fetching client."""
        for service in self.services:
            await service.stop()
        if self.chat is not None:
            self.chat.close()
        await self.stages.close()
        if self._http is not None:
            await self._http.aclose()
