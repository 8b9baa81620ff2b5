"""A video's place in the prompt from its metadata alone, as :mod:`epdserve.frontend.image_slots` does for images.

The front reads the container header (PyAV, no frame decoded: :func:`epdserve.video.probe_video`), samples frames
by the checkpoint's video processor (``sample_frames``) and lays the video out (:func:`plan_video`: grid, timing,
the text that replaces the chat template's ``<|video_pad|>``). That is all the prompt needs, so the gateway builds
it while the encoder decodes the frames, and a decode front, which never runs an encoder, builds the same one. A
video this front cannot read or that is over a limit is refused here, before anything reaches an encoder.
"""

from __future__ import annotations

from typing import Any

from epdserve.frontend.errors import StageError
from epdserve.frontend.prompt import EncodedImage, VideoInput, VideoSlot
from epdserve.hashing import video_key
from epdserve.models.video_layout import plan_video, video_placeholder
from epdserve.video import VideoError, VideoLimits, probe_video


def video_slot(processor: Any, video: VideoInput, limits: VideoLimits = VideoLimits()) -> VideoSlot:
    """Plan ``video`` under ``processor`` (the checkpoint's ``AutoProcessor``: its ``video_processor`` samples and
    sizes, its ``replace_video_token`` writes the placeholder). CPU-bound (demuxes a file whose header has no
    frame count, hashes the bytes): call it off the event loop for large files.

    Raises:
        StageError: 400 for a file PyAV cannot read (corrupt, no video stream, no frames, unsupported codec), a
            video longer than ``limits.max_duration_s`` seconds or sampled to more than ``limits.max_frames``
            frames, a sampling the processor refuses (e.g. more frames than the clip has) or an aspect ratio over
            200.
    """
    try:
        metadata = probe_video(video.data)
        if metadata.duration > limits.max_duration_s:
            raise VideoError(f"the video lasts {metadata.duration:.1f} s, over the limit of "
                             f"{limits.max_duration_s:g} s")
        layout = plan_video(processor.video_processor, metadata, video.fps, video.num_frames)
    except VideoError as e:
        raise StageError(str(e), 400) from None
    except (ValueError, ZeroDivisionError) as e:  # the processor's own refusals (sampling, size); a clip too short
        # to give one temporal patch at the sampling rate (a still image sent as a video) divides by zero there
        raise StageError(f"cannot sample the video ({type(e).__name__}: {e})", 400) from None
    if len(layout.frames_indices) > limits.max_frames:
        raise StageError(f"{len(layout.frames_indices)} frames sampled from the video, over the limit of "
                         f"{limits.max_frames} (lower fps or num_frames in mm_processor_kwargs)", 400)
    t, h, w = layout.grid_thw
    merge = processor.video_processor.merge_size
    encoded = EncodedImage(video_key(video.data, video.fps, video.num_frames), t * h * w // merge**2,
                           list(layout.grid_thw))
    return VideoSlot(video, encoded, layout, video_placeholder(processor, layout))
