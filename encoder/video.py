"""Videos in the encoder: a request's video decoded to the frames its checkpoint's video processor samples, then run
through the batcher as a tower job of its own.

A video never shares a tower call with images or other videos: its patches alone often fill a batch, its grid is a
one-off (no CUDA graph would be reused), and a failure of its preprocessing must fail only its own requests. It
still goes through :class:`~epdserve.encoder.batcher.EncodeBatcher` so that its tower call runs on the single tower
thread between the image batches, never beside one (the tower is not thread-safe), and its processor call on the
batcher's preprocessing thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from epdserve.models.video_layout import frame_sampler, video_grid
from epdserve.video import VideoError, VideoLimits, load_video


@dataclass(frozen=True)
class DecodedVideo:
    """One video after decoding, before the video processor.

    Attributes:
        frames: ``[T, H, W, 3]`` uint8 RGB, the sampled frames in order.
        metadata: ``transformers.video_utils.VideoMetadata`` of the file, ``frames_indices`` = the sampled indices.
        grid_thw: ``[t, h, w]`` the processor will give (:func:`epdserve.models.video_layout.video_grid`).
    """

    frames: np.ndarray
    metadata: Any
    grid_thw: list[int]

    @property
    def patches(self) -> int:
        """Patches before the spatial merge (``t*h*w``): the video's weight in the batcher's budget."""
        t, h, w = self.grid_thw
        return t * h * w


def decode_video(video_processor, data: bytes, fps: float | None, num_frames: int | None, limits: VideoLimits,
                 max_frame_pixels: int) -> DecodedVideo:
    """Decode the frames of ``data`` that ``video_processor`` samples at ``fps`` or ``num_frames`` (None: its
    default, :func:`epdserve.models.video_layout.frame_sampler`). CPU-bound (FFmpeg through PyAV): call it off the
    event loop.

    Args:
        video_processor: the checkpoint's transformers video processor (``VisionEncoder.video_processor``).
        data: the container file's bytes.
        fps, num_frames: the request's sampling, at most one of them.
        limits: duration (s) and sampled-frame bounds.
        max_frame_pixels: largest ``width * height`` of a frame, checked from the stream header before any
            frame is decoded (the encoder's ``--max-image-pixels``).

    Raises:
        VideoError: unreadable or empty file, over a limit, a sampling the processor refuses (e.g. more frames
            than the video has), or a frame shape it refuses (aspect ratio over 200).
    """
    try:
        sampler = frame_sampler(video_processor, fps, num_frames)
    except ValueError as e:
        raise VideoError(str(e)) from None

    def sample(metadata) -> list[int]:
        # Runs on the metadata before any frame is decoded: the cheap place for the per-frame size bound.
        if metadata.width * metadata.height > max_frame_pixels:
            raise VideoError(f"video frames of {metadata.width}x{metadata.height} pixels are larger than the limit "
                             f"of {max_frame_pixels}")
        try:
            return sampler(metadata=metadata)
        except ValueError as e:  # the processor's own check, e.g. num_frames over the video's frames
            raise VideoError(f"cannot sample the video's frames: {e}") from None
        except ZeroDivisionError:  # Qwen2-VL's sample_frames when the rate gives no frame at all (a still image)
            raise VideoError(f"the video ({metadata.total_num_frames} frame(s) at {metadata.fps:g} fps) is too "
                             "short for one frame at its sampling rate") from None

    frames, metadata = load_video(data, sample, limits)
    try:
        grid = video_grid(video_processor, len(frames), metadata.height, metadata.width)
    except ValueError as e:
        raise VideoError(f"the video processor refuses {len(frames)} frame(s) of {metadata.width}x{metadata.height}: "
                         f"{e}") from None
    return DecodedVideo(frames, metadata, grid)


class VideoJob:
    """The :class:`~epdserve.encoder.batcher.ImageEncoder` of one video, so that the batcher runs it as a tower call
    of its own: the batcher puts only items of the same encoder object in one call, and each video gets a new
    ``VideoJob``.

    Attributes:
        is_video: tells the batcher's metrics that this call is a video, not a batch of images.
    """

    is_video = True

    def __init__(self, encoder) -> None:
        """``encoder``: the :class:`~epdserve.encoder.vision.VisionEncoder` whose tower runs the video."""
        self._encoder = encoder

    def preprocess(self, videos: list[DecodedVideo]) -> Any:
        """The video processor on the one video's frames (``VisionEncoder.preprocess_video``).

        Raises:
            VideoError: the processor refuses the frames (a ``ValueError`` from it).
        """
        [video] = videos
        try:
            return self._encoder.preprocess_video(video.frames, video.metadata)
        except ValueError as e:
            raise VideoError(f"the video processor refused the video: {e}") from None

    def run_tower(self, prepared: Any) -> list[tuple[torch.Tensor, list[int]]]:
        """``[(embedding [t*h*w // merge**2, embed_width] on the tower's device, grid_thw)]`` of the video
        (``run_tower``)."""
        return self._encoder.run_tower(prepared)
