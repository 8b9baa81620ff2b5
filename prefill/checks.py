"""The prefill scheduler's checks of what other processes send it: a request against the model and the context
length, and a request's embeddings against its image and video spans. Each returns an error message or None."""

from __future__ import annotations

from epdserve.models.config import ModelConfig
from epdserve.prefill.records import PrefillRecord
from epdserve.wire.messages import PrefillRequest


def validate_request(msg: PrefillRequest, cfg: ModelConfig, context_length: int) -> str | None:
    """Why ``msg`` cannot be prefilled (an empty prompt or one over ``context_length`` tokens, image or video spans
    that do not cover their tokens or disagree with their grid, a token id outside the vocabulary), else None."""
    n = len(msg.input_ids)
    if n == 0:
        return "empty prompt"
    if n >= context_length:
        return f"prompt of {n} tokens does not fit the context length {context_length}"
    for span in msg.images:
        ids, (t, h, w) = msg.input_ids[span.offset:span.offset + span.length], span.grid_thw
        m, kind = cfg.spatial_merge_size, "video" if span.video else "image"
        token = cfg.video_token_id if span.video else cfg.image_token_id
        if span.offset < 0 or len(ids) != span.length or any(i != token for i in ids):
            return f"{kind} span {span.offset}+{span.length} does not cover {kind} tokens"
        if span.embed_offset and not span.video:
            return "an image span with an embedding offset"
        if t * h * w != span.length * m * m:
            return f"image grid {span.grid_thw} does not give {span.length} tokens"
    if any(not 0 <= i < cfg.vocab_size for i in msg.input_ids):
        return "token id out of the vocabulary"
    return None


def check_embeds(req: PrefillRecord, cfg: ModelConfig) -> str | None:
    """Why ``req``'s embeddings (all present) do not fit its spans, else None: one embedding per image or video,
    ``[rows, embed_width]``; a video's spans (a Qwen3-VL one's per temporal patch) take rows ``embed_offset ..
    embed_offset + length`` of it, together all of them."""
    rows: dict[str, int] = {}
    for span in req.msg.images:
        rows[span.image_hash] = max(rows.get(span.image_hash, 0), span.embed_offset + span.length)
    for key, n in rows.items():
        emb = req.embeds[key]
        if emb.dim() != 2 or emb.shape != (n, cfg.embed_width):
            return f"embedding of image or video {key[:12]} has shape {tuple(emb.shape)}, " \
                   f"expected ({n}, {cfg.embed_width})"
    return None
