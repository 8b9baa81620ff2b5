"""Where a video's tokens go, computed from its metadata alone (no frame decoded): which frames the checkpoint's
video processor samples, the vision grid, the prompt text that stands for the video, and its M-RoPE entries.

A front needs this before (or without) running the vision tower: the decode front of a PD pair never sees pixels,
and the gateway builds the prompt while the encoder works. The encoder's own grid is checked against it.

Sources, all transformers 5: the video processors' ``sample_frames`` and ``get_num_of_video_patches`` (their
``smart_resize``; Qwen3-VL spreads its pixel budget over the frames), the processors' ``replace_video_token``
(Qwen2/2.5-VL: ``<|video_pad|>`` repeated; Qwen3-VL: ``<{t:.1f} seconds><|vision_start|><|video_pad|>...
<|vision_end|>`` per temporal patch) and ``get_rope_index`` (see :mod:`epdserve.models.mrope`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class VideoLayout:
    """One video's place in a prompt.

    Attributes:
        frames_indices: source frame indices the processor samples (increasing).
        grid_thw: ``[grid_t, grid_h, grid_w]`` in patches (``grid_t`` temporal patches of ``temporal_patch_size``
            frames; the last is padded by repeating the last frame).
        second_per_grid_t: seconds of playback per temporal patch (``temporal_patch_size / sampled fps``).
        fps: the source's frame rate (frames per second).
    """

    frames_indices: list[int]
    grid_thw: list[int]
    second_per_grid_t: float
    fps: float


DEFAULT_FPS = 2.0  # qwen-vl-utils' and SGLang's rate where the checkpoint's video processor names none


def frame_sampler(video_processor, fps: float | None = None, num_frames: int | None = None):
    """``metadata -> frame indices``: the processor's ``sample_frames`` at a request's ``fps`` or ``num_frames``
    (``mm_processor_kwargs``), else at the processor's own ``fps``, else at :data:`DEFAULT_FPS` (Qwen2/2.5-VL's
    processors sample nothing by default, and every frame of a clip is rarely what a user wants).

    Raises:
        ValueError: both ``fps`` and ``num_frames`` given.
    """
    if fps is not None and num_frames is not None:
        raise ValueError("give fps or num_frames, not both")
    if fps is None and num_frames is None:
        fps = getattr(video_processor, "fps", None) or DEFAULT_FPS
    return functools.partial(video_processor.sample_frames, fps=fps, num_frames=num_frames)


def plan_video(video_processor, metadata, fps: float | None = None, num_frames: int | None = None) -> VideoLayout:
    """The layout of a video of ``metadata`` (``transformers.video_utils.VideoMetadata``: frame count, fps, width,
    height) under ``video_processor``, frames sampled by :func:`frame_sampler`.

    Raises:
        ValueError: ``fps`` and ``num_frames`` both given, or a size the processor refuses (e.g. an aspect
            ratio over 200).
    """
    indices = [int(i) for i in frame_sampler(video_processor, fps, num_frames)(metadata=metadata)]
    grid = video_grid(video_processor, len(indices), metadata.height, metadata.width)
    sampled_fps = metadata.fps * len(indices) / metadata.total_num_frames if metadata.total_num_frames else 0
    spg = video_processor.temporal_patch_size / sampled_fps if sampled_fps else 1.0
    return VideoLayout(indices, grid, spg, float(metadata.fps))


def video_grid(video_processor, num_frames: int, height: int, width: int) -> list[int]:
    """``[grid_t, grid_h, grid_w]`` of ``num_frames`` frames of ``height`` x ``width`` pixels, as the processor's
    ``get_num_of_video_patches`` computes it (which returns only the product)."""
    vp = video_processor
    resize = importlib.import_module(type(vp).__module__).smart_resize
    factor, tp = vp.patch_size * vp.merge_size, vp.temporal_patch_size
    min_pixels, max_pixels = vp.size["shortest_edge"], vp.size["longest_edge"]
    if "num_frames" in inspect.signature(resize).parameters:  # Qwen3-VL: one pixel budget for all frames
        if getattr(vp, "cap_pixels_per_frame", None):
            frame_cap = vp.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        h, w = resize(num_frames, height, width, temporal_factor=tp, factor=factor, min_pixels=min_pixels,
                      max_pixels=max_pixels)
    else:
        h, w = resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return [(num_frames + -num_frames % tp) // tp, h // vp.patch_size, w // vp.patch_size]


def video_placeholder(processor, layout: VideoLayout) -> str:
    """The text that replaces the chat template's ``<|video_pad|>`` for this video: transformers' own
    ``processor.replace_video_token`` on the layout."""
    import torch
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=len(layout.frames_indices), fps=layout.fps,
                         frames_indices=list(layout.frames_indices))
    inputs = {"video_grid_thw": torch.tensor([layout.grid_thw]), "video_metadata": [meta]}
    return processor.replace_video_token(inputs, 0)


# Model types whose processor writes a video as one run of pads per temporal patch between timestamp texts
# (Qwen3VLProcessor; transformers maps qwen3_5 to it too, and Qwen3_5Model.get_rope_index splits the grid alike).
_TIMESTAMPED_VIDEO = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def video_mrope_entries(model_type: str, runs: list[int], layout: VideoLayout, tokens_per_second: float) -> list[tuple]:
    """:func:`epdserve.models.mrope.mrope_positions` entries of one video.

    Args:
        model_type: ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5`` or ``qwen3_5_moe``.
        runs: offsets in the prompt of the video's runs of ``<|video_pad|>`` tokens: one run (Qwen2/2.5-VL), or one
            per temporal patch (Qwen3-VL and Qwen3.5, whose timestamp text between them is ordinary text).
        tokens_per_second: the vision config's (Qwen2.5-VL's temporal scale).

    Raises:
        ValueError: the number of runs does not fit the model type and grid.
    """
    t, h, w = layout.grid_thw
    timestamped = model_type in _TIMESTAMPED_VIDEO
    if len(runs) != (t if timestamped else 1):
        raise ValueError(f"{model_type} video with grid {layout.grid_thw} cannot have {len(runs)} token runs")
    if timestamped:
        return [(offset, [1, h, w]) for offset in runs]
    if model_type == "qwen2_5_vl":
        return [(runs[0], [t, h, w], layout.second_per_grid_t * tokens_per_second)]
    return [(runs[0], [t, h, w])]
