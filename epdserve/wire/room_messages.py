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

from epdserve.wire.codec import Codec


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
decode = _CODEC.decode  # frames -> the message (WireError when they are not one of these)
