"""M-RoPE position ids of a prompt with images, and of decode tokens.

Source: Qwen2-VL paper (arXiv:2409.12191, "Multimodal Rotary Position Embedding") and transformers 5
``Qwen2_5_VLModel.get_rope_index`` / ``get_vision_position_ids``, which this reproduces for images.

Qwen3-VL (transformers' ``Qwen3VLModel.get_rope_index``) gives images the same positions: an image's cell
``(t, h, w)`` is ``(s + t, s + h, s + w)`` and the running start advances by ``max(grid_h, grid_w) // m`` (images
have ``grid_t == 1``). What changes in Qwen3-VL is how the positions are turned into rotary angles (interleaved,
see :func:`epdserve.models.qwen2_vl_lm.mrope_cos_sin`), not the positions.

Video. Qwen2-VL: one block per video, temporal index ``t``. Qwen2.5-VL: one block per video, temporal index
``int(t * second_per_grid_t * tokens_per_second)`` (an entry's ``time_interval``); the running start still advances
by ``max(grid_h, grid_w) // m`` only. Qwen3-VL: the processor writes each frame (``grid_t`` frames, each of
temporal patch 2) as its own block
``<{time:.1f} seconds><|vision_start|><|video_pad|> * (h * w / m**2)<|vision_end|>``, and
``get_rope_index`` splits ``video_grid_thw`` into ``grid_t`` grids ``[1, h, w]``: every frame is positioned like
a one-frame image (temporal index 0 plus the running start) at its own offset, and the timestamp tokens between
frames are ordinary text. So Qwen3-VL video positions are :func:`mrope_positions` with one ``(offset, [1, h,
w])`` entry per frame.
"""

from __future__ import annotations

import torch


def mrope_positions(num_tokens: int, images: list[tuple[int, list[int]] | tuple[int, list[int], float]],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """3D positions of a prompt of ``num_tokens`` tokens whose images sit at the given offsets.

    Args:
        num_tokens: prompt length (> 0).
        images: ``(offset of the image's first token, [grid_t, grid_h, grid_w])`` per image or video, optionally
            with a third element ``time_interval`` (float, default 1: a Qwen2.5-VL video's ``second_per_grid_t *
            tokens_per_second``); it occupies ``grid_t * (grid_h // m) * (grid_w // m)`` tokens from ``offset``
            (``m = spatial_merge_size``).
        spatial_merge_size: the vision tower's spatial merge ``m``.

    Returns:
        ``(positions, delta)``: int64 ``[3, num_tokens]`` (temporal, height, width) and the int
        ``delta = max(positions) + 1 - num_tokens``. Text runs count up by one on all three axes from a running
        start ``s``; an image's token at grid cell ``(t, h, w)`` gets ``(s + int(t * time_interval), s + h, s + w)``,
        after which
        ``s += max(grid_h, grid_w) // m`` (as in transformers). Decode token at sequence index ``i`` has
        position ``i + delta`` on every axis.

    Raises:
        ValueError: ``num_tokens <= 0``, or images overlap, are out of order, or run past the prompt.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    pos = torch.empty(3, num_tokens, dtype=torch.int64)
    start, idx = 0, 0
    for offset, grid, *interval in images:
        gt, gh, gw = (int(g) for g in grid)
        mh, mw = gh // spatial_merge_size, gw // spatial_merge_size
        n = gt * mh * mw
        if offset < idx or offset + n > num_tokens:
            raise ValueError(f"image at offset {offset} with {n} tokens overlaps the previous image or runs past "
                             f"the prompt ({num_tokens} tokens); images must be sorted and disjoint")
        pos[:, idx:offset] = torch.arange(start, start + offset - idx)
        start += offset - idx
        times = (torch.arange(gt) * interval[0]).long() if interval else torch.arange(gt)
        t, h, w = torch.meshgrid(times, torch.arange(mh), torch.arange(mw), indexing="ij")
        pos[:, offset:offset + n] = torch.stack([t, h, w]).reshape(3, -1) + start
        start += max(gh, gw) // spatial_merge_size
        idx = offset + n
    pos[:, idx:] = torch.arange(start, start + num_tokens - idx)
    return pos, int(pos.max()) + 1 - num_tokens


def decode_positions(token_indices: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Positions ``[3, B]`` int64 of decode tokens: ``token_indices + deltas`` (both ``[B]``) on all three axes.

    ``token_indices[b]`` is the token's index in its sequence (prompt length + tokens generated before it);
    ``deltas[b]`` is the request's :func:`mrope_positions` delta.
    """
    return (token_indices.long() + deltas.long()).unsqueeze(0).expand(3, -1).contiguous()
