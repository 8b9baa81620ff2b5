"""Content hashes of images: the key of the encoder's embedding cache, of routing an image to an encoder, and of
image tokens in the radix cache, so the gateway, the prefill front and the encoder must agree on it."""
import hashlib


def sha256_all(datas: list[bytes]) -> list[bytes]:
    """SHA-256 digests (32 bytes each) of ``datas``, in order. About 0.2 s for 100 MB: call it off the event loop."""
    return [hashlib.sha256(d).digest() for d in datas]
