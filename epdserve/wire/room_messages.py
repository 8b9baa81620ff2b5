"""The messages of an encoder's bootstrap port (``--bootstrap-port``): how a prefill front claims the embedding
smg's ``--epd-disaggregation`` had an encoder compute under a bootstrap room (TokenSpeed's EPD rendezvous, on
epdserve's own ZeroMQ wire: :mod:`epdserve.wire.codec`, msgpack, never pickle)::

    prefill front --EmbedClaim(room, rid, image_hash, targets)--> encoder bootstrap port (ROUTER)
    encoder --ImageEmbeddings(rid, [image_hash])--> every prefill TP rank of ``targets`` (the usual push)
    encoder --EmbedClaimReply(room, num_tokens, grid_thw | error)--> prefill front

A claim with no ``targets`` gives the room up (the request was aborted): the encoder drops what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.wire.codec import Codec, WireError


@dataclass
class EmbedClaim:
    """prefill front -> encoder: push the embedding held under ``room`` to ``targets`` (the prefill server's TP-rank
    embedding endpoints) as ``ImageEmbeddings(rid, [image_hash])``, waiting up to ``wait_s`` seconds for its encode
    to finish; ``share_host_id``: the targets' machine (CUDA IPC when it is the encoder's). No ``targets``: drop the
    room."""

    room: int
    rid: str
    image_hash: str
    targets: list[str] = field(default_factory=list)
    share_host_id: str = ""
    wait_s: float = 60.0


@dataclass
class EmbedClaimReply:
    """encoder -> prefill front: the outcome of the claim of ``room``. ``status`` 0: pushed (``num_tokens`` rows
    of grid ``grid_thw``); else an HTTP-style status (400 bad input, 404 no such room, 503 a target took nothing,
    504 the encode did not finish in time, 500 the encode failed) and ``error``."""

    room: int
    status: int = 0
    error: str = ""
    num_tokens: int = 0
    grid_thw: list[int] = field(default_factory=list)


_CODEC = Codec((EmbedClaim, EmbedClaimReply))
encode = _CODEC.encode  # a message -> ZeroMQ frames
_MAX_TARGETS, _MAX_TEXT = 64, 512  # a TP server's ranks; ids, hashes and endpoints


def _int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _text(v: object) -> bool:
    return isinstance(v, str) and len(v) <= _MAX_TEXT


def decode(frames: list) -> EmbedClaim | EmbedClaimReply:
    """Frames -> the message, its fields checked (types, a room in ``[0, 2**63)``, at most 64 ``tcp://`` or
    ``ipc://`` targets, ``0 < wait_s <= 3600``, a 3-number grid).

    Raises:
        WireError: the frames are not one of these messages, or a field is out of range.
    """
    msg = _CODEC.decode(frames)
    if not _int(msg.room, 0, (1 << 63) - 1):
        raise WireError(f"bad room {msg.room!r}")
    if isinstance(msg, EmbedClaim):
        ok = (_text(msg.rid) and _text(msg.image_hash) and _text(msg.share_host_id)
              and isinstance(msg.targets, list) and len(msg.targets) <= _MAX_TARGETS
              and all(_text(t) and t.startswith(("tcp://", "ipc://")) for t in msg.targets)
              and isinstance(msg.wait_s, (int, float)) and 0 < msg.wait_s <= 3600)
    else:
        ok = (_int(msg.status, 0, 599) and _text(msg.error) and _int(msg.num_tokens, 0, 1 << 31)
              and isinstance(msg.grid_thw, list) and len(msg.grid_thw) in (0, 3)
              and all(_int(g, 0, 1 << 20) for g in msg.grid_thw))
    if not ok:
        raise WireError(f"bad {type(msg).__name__} fields")
    return msg
