"""A chat request's media, fetched and checked before anything reaches an encoder: image bytes, and each video
planned from its metadata (:func:`~epdserve.frontend.video_slots.video_slot`); and the check of the encoder's
answer against what the front predicted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from epdserve.frontend.errors import APIError, StageError
from epdserve.frontend.media import MediaError, MediaPolicy, load_media, run_cpu_bound
from epdserve.frontend.prompt import EncodedImage, VideoInput, VideoSlot
from epdserve.frontend.request import VideoSampling
from epdserve.frontend.video_slots import video_slot
from epdserve.video import VideoLimits


@dataclass
class RequestMedia:
    """``images``: each image's file bytes; ``videos``: each video planned; both in prompt order."""

    images: list[bytes]
    videos: list[VideoSlot]


async def fetch_media(image_urls: list[str], video_urls: list[str], sampling: VideoSampling | None,
                      policy: MediaPolicy, http: httpx.AsyncClient | None, processor: Any,
                      limits: VideoLimits) -> RequestMedia:
    """Fetch every image and video of a request concurrently (under ``policy``) and plan the videos with the
    request's ``sampling`` (None: the checkpoint's default) under ``processor`` and ``limits``, off the event loop
    where the work is large.

    Raises:
        APIError: 400/413 for a URL that cannot be used (:class:`MediaError`), 400 for a video that cannot be read,
            is over a limit or cannot be sampled so (``param="messages"``).
    """
    fps, num_frames = (sampling.fps, sampling.num_frames) if sampling is not None else (None, None)
    try:
        files = await asyncio.gather(*(load_media(u, policy, http, "image") for u in image_urls),
                                     *(load_media(u, policy, http, "video") for u in video_urls))
        # One at a time: each may demux a whole file, and a request's videos are few.
        videos = [await run_cpu_bound(len(data), video_slot, processor, VideoInput(data, fps, num_frames), limits)
                  for data in files[len(image_urls):]]
    except MediaError as e:
        raise APIError(e.status, e.message, param="messages") from None
    except StageError as e:
        raise APIError(e.status, f"video: {e.message}", param="messages") from None
    return RequestMedia(list(files[:len(image_urls)]), videos)


def check_encoded(encoded: list[EncodedImage], expected: list[EncodedImage]) -> None:
    """Raise StageError 500 unless the encoder reported each image and video as the front predicted it (same
    hash, token count and grid): the prompt sent ahead of the embeddings was built from the prediction."""
    if len(encoded) != len(expected):
        raise StageError(f"the encoder reported {len(encoded)} results for {len(expected)} images and videos", 500)
    for i, (got, want) in enumerate(zip(encoded, expected)):
        if got != want:
            raise StageError(f"the encoder reported item {i} as {got.num_tokens} tokens of grid {got.grid_thw} "
                             f"(hash {got.image_hash[:12]}), the gateway expected {want.num_tokens} tokens of grid "
                             f"{want.grid_thw} (hash {want.image_hash[:12]}): are the encoder and the gateway "
                             "serving the same checkpoint?", 500)
