"""The encoder's ``GetModelInfo`` and ``GetServerInfo`` answers (its ``/get_model_info`` and ``/get_server_info``,
as gRPC methods of ``epdserve.v1.Encoder``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import epdserve
from epdserve.proto import encoder_pb2

if TYPE_CHECKING:
    from epdserve.config import EncoderConfig
    from epdserve.encoder.batcher import EncodeBatcher
    from epdserve.encoder.cache import EmbeddingCache
    from epdserve.encoder.vision import VisionEncoder
    from epdserve.encoder.metrics import EncoderMetrics


def model_info(encoder: VisionEncoder) -> encoder_pb2.GetModelInfoResponse:
    """The loaded vision model: path, model type, device, dtype, the patch geometry of its config and its DeepStack
    levels (an embedding is ``[num_tokens, out_hidden_size * (1 + num_deepstack_levels)]``)."""
    cfg = encoder.model.config
    return encoder_pb2.GetModelInfoResponse(
        model_path=encoder.model_path, model_type=encoder.model_type, device=str(encoder.device),
        dtype=str(encoder.dtype).removeprefix("torch."), patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
        # Qwen2.5-VL's vision config names the LM width out_hidden_size; Qwen2-VL's names it hidden_size.
        out_hidden_size=getattr(cfg, "out_hidden_size", None) or cfg.hidden_size,
        num_deepstack_levels=encoder.num_deepstack)


def server_info(config: EncoderConfig | None, ready: bool, metrics_port: int, cache: EmbeddingCache,
                batcher: EncodeBatcher, metrics: EncoderMetrics) -> encoder_pb2.GetServerInfoResponse:
    """Flags (every ``EncoderConfig`` field as text), readiness, metrics port, cache and batcher state."""
    flags = {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config)} if config is not None else {}
    stats = cache.stats()
    return encoder_pb2.GetServerInfoResponse(
        flags=flags, version=epdserve.__version__, ready=ready, metrics_port=metrics_port,
        cache_entries=stats["entries"], cache_bytes=stats["size_bytes"],
        cache_capacity_bytes=stats["capacity_bytes"], cache_hits=stats["hits"], cache_misses=stats["misses"],
        tower_calls=batcher.calls, queued_images=batcher.queued,
        running_requests=int(metrics.value("epdserve:num_running_reqs")))
