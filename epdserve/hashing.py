"""Content hashes of images: the key of the encoder's embedding cache, of routing an image to an encoder, and of
image tokens in the radix cache, so the gateway, the prefill front and the encoder must agree on it."""
import hashlib


def image_pad_id(image_hash: str) -> int:
    """Radix-cache key id for every token of an image: above any vocabulary id and unique per image hash
    (60 bits of the SHA-256), so equal images at equal places share KV and different images never do. The prefill
    server keys its cache with it, and the gateway its approximate copy of that cache (gateway/routing.py)."""
    return (1 << 62) | int(image_hash[:15], 16)


def sha256_all(datas: list[bytes]) -> list[bytes]:
    """SHA-256 digests (32 bytes each) of ``datas``, in order. About 0.2 s for 100 MB: call it off the event loop."""
    return [hashlib.sha256(d).digest() for d in datas]


def video_key(data: bytes, fps: float | None = None, num_frames: int | None = None) -> str:
    """The cache and routing key of a video's embeddings (hex SHA-256): its bytes and the frame sampling asked for
    (a request's ``mm_processor_kwargs`` ``fps`` / ``num_frames``; None: the checkpoint's default), since the same
    file sampled differently gives other embeddings. Hex like an image hash, so the radix cache's
    :func:`image_pad_id` takes it as it takes an image's.

    Raises:
        ValueError: both ``fps`` and ``num_frames`` given, or either not positive.
    """
    if fps is not None and num_frames is not None:
        raise ValueError("give fps or num_frames, not both")
    if (fps is not None and not fps > 0) or (num_frames is not None and num_frames <= 0):
        raise ValueError(f"fps and num_frames must be positive, got fps={fps} num_frames={num_frames}")
    sampling = f"video;fps={float(fps) if fps is not None else ''};num_frames={num_frames or ''}".encode()
    return hashlib.sha256(hashlib.sha256(data).digest() + sampling).hexdigest()
