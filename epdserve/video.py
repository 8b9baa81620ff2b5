"""Reading a video file: its metadata without decoding, and the frames a checkpoint's video processor samples.

PyAV (its wheels bundle FFmpeg, so nothing comes from the system) demuxes and decodes; which frames to keep is the
video processor's own ``sample_frames`` (fps, min/max frames), passed in as ``sample_indices_fn``, so the frames
are the ones ``transformers`` would pick. This mirrors ``transformers.video_utils.read_video_pyav``, which cannot be
used as is: it reads the frame count from the container header, which WebM files leave at 0, and it fails with an
IndexError rather than a message on a video with no frames.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

_CONVERT_THREADS = 4  # threads converting decoded frames to RGB, per video being decoded


class VideoError(ValueError):
    """The bytes are not a video this server can read (corrupt, no video stream, no frames, unsupported codec) or
    the video is over a limit. The message says which; a front answers it with HTTP 400."""


@dataclass(frozen=True)
class VideoLimits:
    """Bounds a request's video must keep.

    Attributes:
        max_frames: most frames sampled from one video (after the processor's fps sampling).
        max_duration_s: longest video accepted, in seconds of playback.
    """

    max_frames: int = 768
    max_duration_s: float = 600.0


def probe_video(data: bytes):
    """Metadata of the video in ``data`` without decoding a frame: frame count, fps, duration (s), width, height.

    Returns:
        ``transformers.video_utils.VideoMetadata`` (``video_backend="pyav"``, ``frames_indices`` None).

    Raises:
        VideoError: not a container PyAV can open, no video stream, no frames, no frame rate or size.
    """
    import av
    from transformers.video_utils import VideoMetadata

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise VideoError("the file has no video stream")
            stream = container.streams.video[0]
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            width, height = stream.codec_context.width, stream.codec_context.height
    except av.FFmpegError as e:
        raise VideoError(f"cannot read the video: {e}") from None
    if total <= 0:
        raise VideoError("the video has no frames")
    if fps <= 0:
        raise VideoError("the video has no frame rate")
    if not width or not height:
        raise VideoError("the video has no frame size (not a video FFmpeg can decode)")
    return VideoMetadata(total_num_frames=int(total), fps=fps, duration=total / fps, width=width, height=height,
                         video_backend="pyav")


def load_video(data: bytes, sample_indices_fn: Callable, limits: VideoLimits = VideoLimits()):
    """Decode the frames of ``data`` that ``sample_indices_fn(metadata=...)`` picks.

    Args:
        data: the file (MP4, WebM, anything FFmpeg demuxes).
        sample_indices_fn: the video processor's ``sample_frames`` (a ``functools.partial`` with the request's
            ``fps``/``num_frames``): metadata -> increasing frame indices.
        limits: duration and sampled-frame bounds.

    Returns:
        ``(frames, metadata)``: frames ``[T, H, W, 3]`` uint8 RGB, ``T = len(metadata.frames_indices)``.

    Raises:
        VideoError: unreadable (see :func:`probe_video`), over ``limits``, or a sampled frame that does not decode.
    """
    import av

    metadata = probe_video(data)
    if metadata.duration > limits.max_duration_s:
        raise VideoError(f"the video lasts {metadata.duration:.1f} s, over the limit of {limits.max_duration_s:g} s")
    indices = [int(i) for i in sample_indices_fn(metadata=metadata)]
    if not indices:
        raise VideoError("no frames were sampled from the video")
    if len(indices) > limits.max_frames:
        raise VideoError(f"{len(indices)} frames sampled from the video, over the limit of {limits.max_frames} "
                         "(lower fps or num_frames in mm_processor_kwargs)")
    wanted, frames = set(indices), {}
    try:
        # The RGB conversion (swscale, which PyAV runs without the GIL) takes twice as long as decoding: frames
        # are converted on a few threads while the next ones decode (3x faster for an 8 s 640x360 clip, the
        # same bytes).
        with ThreadPoolExecutor(_CONVERT_THREADS) as pool, av.open(io.BytesIO(data)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames[i] = pool.submit(frame.to_ndarray, format="rgb24")
                if i >= indices[-1]:
                    break
            frames = {i: f.result() for i, f in frames.items()}
    except av.FFmpegError as e:
        raise VideoError(f"cannot decode the video: {e}") from None
    missing = sorted(wanted - frames.keys())
    if missing:
        raise VideoError(f"frame {missing[0]} of {metadata.total_num_frames} did not decode")
    metadata.frames_indices = indices
    return np.stack([frames[i] for i in indices]), metadata
