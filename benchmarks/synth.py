"""Synthetic prompt material: random text of a target token length, random images, and ``data:`` URLs.

Everything takes an explicit ``numpy.random.Generator`` so a dataset built twice from one seed is identical.
"""

from __future__ import annotations

import base64
import fractions
import io
import mimetypes
from pathlib import Path

import numpy as np
from PIL import Image

# Common English words: each is one token in the BPE vocabularies of Qwen2 and most other LLMs (with the
# leading space), which is what makes "one word = one token" a fair estimate when no tokenizer is given.
WORDS = tuple(
    """
    the of and to in is was for on that with as by at from his her this which an are be or had it not have
    but were all they one their has been there when who will more no if out so said what up its about into
    than them can only other new some could time these two may then do first any like now my such make over
    our even most me state after also made many did must before back see through way where get much go well
    your know should down work year because come people just say each those take day good how long own find
    part place last great high old world between both life being under never city left came show large small
    every found still around might hand house again point next went three children few early light water
    side night head told country road court open keep story while body line near power plan black white
    red green blue river stone tree field market table window paper music garden summer winter morning voice
    """.split()
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")


class TextMaker:
    """Random text of a target token length, exact with a tokenizer and approximate (words) without.

    Args:
        tokenizer_path: a local ``tokenizer.json``, a checkpoint directory holding one, or a hub id (its
            ``tokenizer.json`` fetched into the Hugging Face cache, or found there); ``None`` counts one token per
            whitespace-separated word.

    Raises:
        ModelSourceError: a hub id whose tokenizer cannot be had.
    """

    def __init__(self, tokenizer_path: str | Path | None = None):
        self._tok = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            from epdserve.models.hub import is_hub_id, tokenizer_file

            path = tokenizer_file(str(tokenizer_path)) if is_hub_id(str(tokenizer_path)) else Path(tokenizer_path)
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    @property
    def exact(self) -> bool:
        """Whether token counts come from a real tokenizer (otherwise they are word counts)."""
        return self._tok is not None

    def count(self, text: str) -> int:
        """Tokens in ``text`` (special tokens not added); words when no tokenizer was given."""
        if self._tok is None:
            return len(text.split())
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def text(self, rng: np.random.Generator, num_tokens: int) -> str:
        """Random words whose token count is ``num_tokens`` (re-encoding the result may differ by a token or two
        where the tokenizer merges across the cut, as in vLLM's random dataset)."""
        if num_tokens <= 0:
            return ""
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=num_tokens)]
        if self._tok is None:
            return " ".join(words)
        # Words are usually one token each, so the first draw is close; top up, then cut at the exact id count.
        ids = self._tok.encode(" ".join(words), add_special_tokens=False).ids
        while len(ids) < num_tokens:
            words += [WORDS[i] for i in rng.integers(0, len(WORDS), size=num_tokens - len(ids))]
            ids = self._tok.encode(" ".join(words), add_special_tokens=False).ids
        return self._tok.decode(ids[:num_tokens])


def parse_size(text: str) -> tuple[int, int]:
    """``"448x336"`` -> ``(448, 336)`` (width, height in pixels)."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.strip().isdigit() or not h.strip().isdigit() or int(w) <= 0 or int(h) <= 0:
        raise ValueError(f"image size must look like WIDTHxHEIGHT, e.g. 448x448, got {text!r}")
    return int(w), int(h)


def random_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image of uniform noise: every request gets different pixels, so no embedding cache can hit."""
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), "RGB")


def image_data_url(image: Image.Image, fmt: str = "jpeg") -> str:
    """Encode ``image`` as a ``data:image/<fmt>;base64,...`` URL (``fmt`` is ``jpeg`` or ``png``)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt.upper(), **({"quality": 90} if fmt.lower() in ("jpeg", "jpg") else {}))
    mime = "jpeg" if fmt.lower() in ("jpeg", "jpg") else fmt.lower()
    return f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def random_video(rng: np.random.Generator, width: int, height: int, frames: int, fps: float) -> bytes:
    """An H.264 MP4 clip (PyAV) of ``frames`` frames at ``fps``: a colour gradient of random hues with a block that
    moves across it and a little noise, so every clip differs (no embedding cache can hit) while compressing like
    video rather than noise.

    Raises:
        ValueError: a non-positive size, frame count or rate, or an odd width or height (H.264's 4:2:0).
    """
    import av

    if width <= 0 or height <= 0 or frames <= 0 or fps <= 0:
        raise ValueError(f"video size, frames and fps must be positive, got {width}x{height}, {frames}, {fps}")
    if width % 2 or height % 2:
        raise ValueError(f"H.264 needs an even width and height, got {width}x{height}")
    ramp = np.add.outer(np.linspace(0, 1, height), np.linspace(0, 1, width))[..., None] / 2  # [h, w, 1]
    lo, hi = rng.integers(0, 128, 3), rng.integers(128, 256, 3)
    base = (lo + ramp * (hi - lo)).astype(np.float32)
    bw, bh = max(2, width // 6), max(2, height // 6)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        # ultrafast: quick to make, and (no lookahead) the same bytes every time; the default preset gave runs
        # of the same frames different bytes.
        stream = container.add_stream("libx264", rate=fractions.Fraction(fps).limit_denominator(1000),
                                      options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        kept = []  # PyAV's frame may point into the array while x264 holds it for lookahead: keep them alive
        for i in range(frames):
            frame = base + rng.normal(0, 1.5, base.shape).astype(np.float32)
            x = int((width - bw) * i / max(1, frames - 1))
            frame[height // 3:height // 3 + bh, x:x + bw] = 255 - frame[height // 3:height // 3 + bh, x:x + bw]
            kept.append(np.clip(frame, 0, 255).astype(np.uint8))
            for packet in stream.encode(av.VideoFrame.from_ndarray(kept[-1], format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_data_url(data: bytes, mime: str = "video/mp4") -> str:
    """``data`` as a ``data:video/...;base64,...`` URL."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def file_data_url(path: str | Path) -> str:
    """A local image file as a ``data:`` URL, bytes unchanged (the server decodes the original file)."""
    path = Path(path)
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def list_images(folder: str | Path, suffixes: tuple[str, ...] = ()) -> list[Path]:
    """Image files (or files with ``suffixes``) directly in ``folder``, sorted by name (so a seed picks the same
    files everywhere).

    Raises:
        FileNotFoundError: no such folder, or none of those files in it.
    """
    suffixes = suffixes or IMAGE_SUFFIXES
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"directory {folder} does not exist")
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in suffixes and p.is_file())
    if not paths:
        raise FileNotFoundError(f"no files ({', '.join(suffixes)}) in {folder}")
    return paths
