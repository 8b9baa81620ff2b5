"""Turn an ``image_url`` or ``video_url`` into the file's bytes, under the gateway's media policy.

The gateway never decodes images or videos: the encoder does (and rejects undecodable ones with INVALID_ARGUMENT).
Here we only fetch bytes and enforce where they may come from and how large they may be, so an oversized or
forbidden file is refused before it costs the encoder anything. Images and videos share the policy but for the
size limit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlparse

import httpx

# Below this many bytes a thread hop costs more than the work; above it, base64 decoding or hashing would stall
# every other request on the event loop (about 1 ms per MB).
_INLINE_BYTES = 256 * 1024
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.IGNORECASE)
_WHITESPACE = b" \t\n\r\v\f"  # what base64 line wrapping may insert (ASCII whitespace)
T = TypeVar("T")
MAX_VIDEO_BYTES = 250 * 1024 * 1024
# Media types a data: URL of each kind may name; FFmpeg finds a video's container itself, so an untyped payload
# (application/octet-stream, what many clients send for a file) is taken as a video too.
_DATA_TYPES = {"image": ("image/",), "video": ("video/", "application/octet-stream")}


class MediaError(Exception):
    """An image or video URL that cannot be used. ``status`` is the HTTP status to answer with (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class MediaPolicy:
    """Where images and videos may come from and how large they may be.

    Attributes:
        max_bytes: largest image in bytes (after base64 decoding).
        allow_remote: fetch ``http(s)://`` URLs.
        local_root: allow ``file://`` URLs under this directory ("" = never).
        fetch_timeout_s: timeout of one remote fetch, in seconds.
        max_video_bytes: largest video in bytes (after base64 decoding). The default stays under the 256 MiB gRPC
            message that carries the video to the encoder, with room for the rest of the message.
    """

    max_bytes: int
    allow_remote: bool = False
    local_root: str = ""
    fetch_timeout_s: float = 30.0
    max_video_bytes: int = MAX_VIDEO_BYTES

    def limit(self, kind: str) -> int:
        """The byte limit of a ``kind`` ("image" or "video") file."""
        return self.max_video_bytes if kind == "video" else self.max_bytes


async def load_image(url: str, policy: MediaPolicy, http: httpx.AsyncClient | None = None) -> bytes:
    """Return the bytes of the image at ``url`` (``data:``, ``http(s)://`` or ``file://``).

    ``http`` is the client used for remote URLs (a short-lived one is made when None).

    Raises:
        MediaError: forbidden scheme or path, malformed data URL or base64, fetch failure (400), or an image
            larger than ``policy.max_bytes`` (413).
    """
    return await load_media(url, policy, http, "image")


async def load_media(url: str, policy: MediaPolicy, http: httpx.AsyncClient | None = None,
                     kind: str = "image") -> bytes:
    """Return the bytes of the ``kind`` ("image" or "video") file at ``url``, as :func:`load_image` does; a video
    is limited to ``policy.max_video_bytes`` and its data URL names ``video/*`` or ``application/octet-stream``.

    Raises:
        MediaError: as :func:`load_image`.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await run_cpu_bound(len(url), decode_data_url, url, policy.limit(kind), kind)
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise MediaError(f"remote {kind} URLs are disabled on this server (start it with "
                             f"--allow-remote-images); send the {kind} as a data: URL")
        return await _fetch(url, policy, http, kind)
    if scheme == "file":
        return await asyncio.to_thread(_read_local, url, policy, kind)
    raise MediaError(f"unsupported {kind} URL scheme {scheme!r}; use a data:{kind}/...;base64 URL")


async def run_cpu_bound(nbytes: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, on the loop's default executor when it works on ``nbytes`` > 256 KiB, else inline.

    For CPU work proportional to a payload (base64 decoding, hashing) that must not stall the event loop.
    """
    if nbytes > _INLINE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def decode_data_url(url: str, max_bytes: int, kind: str = "image") -> bytes:
    """Decode ``data:<type>;base64,<payload>`` of a ``kind`` ("image": ``image/*``; "video": ``video/*`` or
    ``application/octet-stream``) file.

    Raises:
        MediaError: not a data URL of that kind, not base64, invalid base64 (400), or over ``max_bytes`` (413).
    """
    m = _DATA_URL.match(url)
    if m is None:
        raise MediaError(f"malformed data URL; expected data:{kind}/<type>;base64,<data>")
    mime = m.group("mime").strip().lower()
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if not mime.startswith(_DATA_TYPES[kind]):
        raise MediaError(f"data URL has media type {mime or 'text/plain'!r}; expected {kind}/*")
    if "base64" not in params:
        raise MediaError(f"data URL must be base64-encoded (data:{kind}/<type>;base64,...)")
    payload = url[m.end():].encode("ascii", errors="replace")
    # Refuse before decoding: the decoded size is about 3/4 of the payload, so a huge payload costs no memory.
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise MediaError(f"{kind} is larger than the limit of {max_bytes} bytes", status=413)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # Line-wrapped base64 is valid too. Stripping whitespace only when needed keeps the usual case at the
        # decoder's own speed (a regex substitution took 16 ms on a 1280x720 JPEG, 4x the decode).
        try:
            data = base64.b64decode(payload.translate(None, _WHITESPACE), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"invalid base64 in {kind} data URL: {e}") from None
    if not data:
        raise MediaError(f"{kind} data URL is empty")
    if len(data) > max_bytes:
        raise MediaError(f"{kind} of {len(data)} bytes is larger than the limit of {max_bytes} bytes", status=413)
    return data


async def _fetch(url: str, policy: MediaPolicy, http: httpx.AsyncClient | None, kind: str) -> bytes:
    own = http is None
    client = http or httpx.AsyncClient(follow_redirects=True)
    limit = policy.limit(kind)
    try:
        async with client.stream("GET", url, timeout=policy.fetch_timeout_s) as resp:
            if resp.status_code != 200:
                raise MediaError(f"fetching {kind} {url} failed: HTTP {resp.status_code}")
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > limit:  # stop downloading as soon as the limit is passed
                    raise MediaError(f"{kind} at {url} is larger than the limit of {limit} bytes", status=413)
            return bytes(buf)
    except httpx.HTTPError as e:
        raise MediaError(f"fetching {kind} {url} failed: {e}") from None
    finally:
        if own:
            await client.aclose()


def _read_local(url: str, policy: MediaPolicy, kind: str) -> bytes:
    if not policy.local_root:
        raise MediaError(f"file:// {kind} URLs are disabled on this server (see --allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file URL host {parsed.netloc!r} is not allowed")
    # resolve() follows symlinks and '..', so a link inside the root cannot point outside it.
    root = Path(policy.local_root).resolve()
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"file {path} is outside the allowed media directory")
    limit = policy.limit(kind)
    try:
        size = path.stat().st_size
        if size > limit:
            raise MediaError(f"{kind} of {size} bytes is larger than the limit of {limit} bytes", status=413)
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"cannot read {kind} file {path}: {e.strerror}") from None
