"""An image's token count and patch grid from its size alone, as the Qwen2-VL image processor would make them.

The decode server's HTTP front builds the same prompt as the prefill server's but never runs the vision tower: it
only needs how many ``<|image_pad|>`` tokens each image takes. That follows from the image's width and height
(read from the file header, no pixel decoded) by the processor's own resize rule (transformers'
``smart_resize``: both sides rounded to multiples of ``patch_size * merge_size`` within ``[min_pixels,
max_pixels]``), exactly as the encoder's processor computes it for the prefill side.
"""

from __future__ import annotations

import hashlib
from io import BytesIO
from typing import Any

from PIL import Image

from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.errors import StageError

_MAX_PIXELS = 64_000_000  # the encoder's default --max-image-pixels


def image_slots(image_processor: Any, data: bytes, max_pixels: int = _MAX_PIXELS) -> EncodedImage:
    """The :class:`EncodedImage` (SHA-256 hash, tokens, ``[t, h, w]`` patch grid) the encoder would report.

    Args:
        image_processor: the checkpoint's Qwen2-VL image processor (``patch_size``, ``merge_size``, ``size`` with
            ``shortest_edge``/``longest_edge`` as min/max pixels).
        data: the image file's bytes.
        max_pixels: largest ``width * height`` accepted.

    Raises:
        StageError: 400 for bytes PIL cannot identify, an image over ``max_pixels``, or an aspect ratio the
            processor rejects (over 200).
    """
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    try:
        width, height = Image.open(BytesIO(data)).size  # reads the header only
    except Exception as e:  # PIL reports bad data through several unrelated types
        raise StageError(f"cannot decode image: {type(e).__name__}: {e}", 400) from None
    if width * height > max_pixels:
        raise StageError(f"image of {width}x{height} pixels is larger than the limit of {max_pixels}", 400)
    patch, merge = image_processor.patch_size, image_processor.merge_size
    try:
        h, w = smart_resize(height, width, patch * merge, min_pixels=image_processor.size["shortest_edge"],
                            max_pixels=image_processor.size["longest_edge"])
    except ValueError as e:
        raise StageError(f"unsupported image shape {width}x{height}: {e}", 400) from None
    grid = [1, h // patch, w // patch]  # one temporal patch: a still image is repeated to temporal_patch_size
    return EncodedImage(hashlib.sha256(data).hexdigest(), grid[1] * grid[2] // merge**2, grid)
