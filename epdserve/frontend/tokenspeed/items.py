"""TokenSpeed's multimodal items (``tokenspeed.grpc.scheduler.MultimodalItem``, smg-grpc-proto) read and checked
against this checkpoint's image processor: what the encoder's ``TokenSpeedEncoder/Encode`` and the prefill front's
``TokenSpeedScheduler/Generate`` both receive from smg in ``--epd-disaggregation`` mode.

smg has fetched each image and run the model's preprocessing itself; an item carries the image's patches
(``encoder_input``, ``[t*h*w, channels * temporal_patch * patch**2]``; the prefill leg's is empty), its patch grid
(``model_specific_tensors["image_grid_thw"]``), the run of image tokens it stands for in the prompt
(``placeholders``) and smg's hash of the image file (``content_hash``, BLAKE3). The grid must be one this
checkpoint's processor could make (``h`` and ``w`` multiples of the merge size, pixels within its min/max), the
run exactly as long as the grid's token count, and the patches exactly the grid's: otherwise the language model
would get embeddings that do not fit its prompt, so the request is refused (INVALID_ARGUMENT) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epdserve.frontend.grpc_tensor import InvalidRequest, decode_tensor

_IMAGE, _UNSPECIFIED = 1, 0  # smg.grpc.common.Modality: MODALITY_UNSPECIFIED = 0, IMAGE = 1


def tensor_from_proto(t: Any, what: str) -> torch.Tensor:
    """A TokenSpeed ``TensorData`` (inline little-endian bytes, shape, dtype name) as a CPU tensor (floats keep
    their dtype; integers become int64).

    Raises:
        InvalidRequest: a shared-memory or RDMA payload (this worker takes inline tensors only: smg's default
            ``SMG_MM_TENSOR_TRANSPORT=inline``), an unknown dtype, or bytes that do not fill the shape.
    """
    if t.WhichOneof("payload") not in ("inline", None):
        raise InvalidRequest(f"{what} arrived as a {t.WhichOneof('payload')} handle; this worker takes inline "
                             "tensors only (run smg with SMG_MM_TENSOR_TRANSPORT=inline, its default)")
    return decode_tensor(t.inline, t.shape, t.dtype, what)


@dataclass
class ImageItem:
    """One checked image item: ``image_hash`` (hex of smg's content hash: the encoder's cache key and the
    prefill's radix-cache key of the image), its ``[t, h, w]`` patch grid and its run of image tokens
    ``input_ids[offset:offset + length]``."""

    image_hash: str
    grid_thw: list[int]
    offset: int
    length: int


@dataclass
class ProcessorLimits:
    """What a grid must satisfy for this checkpoint's image processor (Qwen2-VL family ``image_processor``)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int

    @classmethod
    def of(cls, image_processor: Any, image_token_id: int) -> ProcessorLimits:
        """The limits of a transformers Qwen2-VL-family image processor (``size`` = shortest/longest edge in
        pixels, as the processor names its min/max pixel counts)."""
        size = image_processor.size
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        return cls(image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size,
                   int(get("shortest_edge") or 0), int(get("longest_edge") or 1 << 62), image_token_id)

    @property
    def patch_dim(self) -> int:
        """Values per patch row of ``encoder_input``: 3 channels x temporal patch x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size**2


def image_item(item: Any, index: int, limits: ProcessorLimits) -> ImageItem:
    """Check one ``MultimodalItem`` (number ``index`` in the request, for messages) and return what it says.

    Raises:
        InvalidRequest: not an image, no content hash, not exactly one placeholder run, another image token, a
            grid the processor could not make, or a run whose length is not the grid's token count.
    """
    if item.modality not in (_IMAGE, _UNSPECIFIED):
        raise InvalidRequest(f"item {index}: only images are supported (modality {item.modality})")
    if not item.content_hash:
        raise InvalidRequest(f"item {index}: content_hash is empty")
    if item.HasField("placeholder_token_id") and item.placeholder_token_id != limits.image_token_id:
        raise InvalidRequest(f"item {index}: placeholder_token_id {item.placeholder_token_id} is not this model's "
                             f"image token {limits.image_token_id}")
    if len(item.placeholders) != 1:
        raise InvalidRequest(f"item {index}: {len(item.placeholders)} placeholder ranges; an image has one")
    if "image_grid_thw" not in item.model_specific_tensors:
        raise InvalidRequest(f"item {index}: model_specific_tensors lacks image_grid_thw")
    grid = tensor_from_proto(item.model_specific_tensors["image_grid_thw"], f"item {index} image_grid_thw")
    grid = [int(v) for v in grid.reshape(-1).tolist()]
    m, p = limits.merge_size, limits.patch_size
    if len(grid) != 3 or grid[0] != 1 or grid[1] % m or grid[2] % m or min(grid) <= 0:
        raise InvalidRequest(f"item {index}: image_grid_thw {grid} is not an image grid of this model's processor "
                             f"([1, h, w] with h and w multiples of {m})")
    pixels = grid[1] * grid[2] * p * p
    if not limits.min_pixels <= pixels <= limits.max_pixels:
        raise InvalidRequest(f"item {index}: image_grid_thw {grid} is {pixels} pixels; this model's processor "
                             f"resizes to {limits.min_pixels}..{limits.max_pixels} (check the processor config smg "
                             "reads)")
    holder = item.placeholders[0]
    tokens = grid[0] * grid[1] * grid[2] // (m * m)
    if holder.length != tokens:
        raise InvalidRequest(f"item {index}: {holder.length} placeholder tokens, but this model's processor makes "
                             f"{tokens} tokens of grid {grid}")
    return ImageItem(bytes(item.content_hash).hex(), grid, holder.offset, holder.length)


def item_pixels(item: Any, checked: ImageItem, limits: ProcessorLimits) -> torch.Tensor:
    """The item's ``encoder_input`` as a ``[t*h*w, patch_dim]`` float tensor, checked against its grid.

    Raises:
        InvalidRequest: no pixels, or a shape other than the grid's patches.
    """
    pixels = tensor_from_proto(item.encoder_input, "encoder_input")
    if not pixels.is_floating_point():
        raise InvalidRequest(f"encoder_input has integer dtype {item.encoder_input.dtype}")
    want = [checked.grid_thw[0] * checked.grid_thw[1] * checked.grid_thw[2], limits.patch_dim]
    if list(pixels.shape) != want:
        raise InvalidRequest(f"encoder_input has shape {list(pixels.shape)}; grid {checked.grid_thw} of this model's "
                             f"processor needs {want}")
    return pixels

