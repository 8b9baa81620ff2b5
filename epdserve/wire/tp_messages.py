"""Messages inside one tensor-parallel server: rank 0 (the server process) <-> ranks 1..N-1, over 127.0.0.1."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the gateway imports these without torch (issue 43)
    import torch

from epdserve.wire.engine_region import KVEngineRegion


@dataclass
class TPHello:
    """TP rank ``rank`` -> rank 0: loaded, warmed up, listening (for embeddings on a prefill server, at
    ``embed_endpoint``, a port the rank bound itself so no two processes race for one chosen in advance). With
    ``--kv-transfer nixl|mooncake``, ``kv_region`` is where this rank's own transfer engine reaches its KV pool
    shard (decode ranks name it at bootstrap, one region per rank)."""

    rank: int
    embed_endpoint: str = ""
    kv_region: KVEngineRegion | None = None


@dataclass
class TPForward:
    """TP rank 0 -> other ranks: run this forward now (a ``ForwardBatch``).

    The token ids are not here: they follow as a ``torch.distributed`` broadcast inside the forward (rank 0 may
    hold them only on its device). Image rows are named, not sent: ``mm_sources`` lists per block of
    ``mm_embeds`` rows ``[rid, image_hash, start, end]`` of that rank's own copy of the embeddings; ``mm_mask``
    is ``[num_tokens]`` uint8 (1 = an image row). ``positions`` ``[3, T]`` and ``out_slots`` ``[T]`` are int64.
    """

    is_decode: bool
    num_tokens: int
    positions: torch.Tensor
    out_slots: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    page_table: list[list[int]]
    mm_mask: torch.Tensor | None = None
    mm_sources: list[list] = field(default_factory=list)
    state_slots: list[int] | None = None  # hybrid models: ForwardBatch.state_slots
    state_snapshots: list[list[int]] | None = None  # hybrid models: ForwardBatch.state_snapshots


@dataclass
class TPReadKV:
    """TP rank 0 -> other ranks: take part in gathering the KV at ``slots`` (int64 ``[n]``) from every rank."""

    slots: torch.Tensor


@dataclass
class TPWriteKV:
    """TP rank 0 -> other ranks: receive a KV of ``shape`` (``[layers, 2, n, kv_heads, head_dim]``, all heads) by
    broadcast and store this rank's heads at ``slots`` (int64 ``[n]``)."""

    slots: torch.Tensor
    shape: list[int]


@dataclass
class TPReadState:
    """TP rank 0 -> other ranks (hybrid models): take part in gathering state slot ``slot``'s whole
    linear-attention state from every rank (:func:`epdserve.engine.state_io.read_state`)."""

    slot: int


@dataclass
class TPWriteState:
    """TP rank 0 -> other ranks (hybrid models): receive a whole state by broadcast and store this rank's heads in
    slot ``slot`` (:func:`epdserve.engine.state_io.write_state`)."""

    slot: int


@dataclass
class TPCopyState:
    """TP rank 0 -> other ranks (hybrid models): copy state slot ``src`` into ``dst`` (a prefix-cache snapshot
    taken or restored)."""

    src: int
    dst: int


@dataclass
class TPReleaseEmbeddings:
    """TP rank 0 -> other ranks: drop your copies of these requests' image embeddings."""

    rids: list[str]


@dataclass
class TPShutdown:
    """TP rank 0 -> other ranks: the server stops; exit."""


@dataclass
class TPEmbedReceipt:
    """TP rank ``rank`` -> rank 0: it holds the embeddings of ``image_hashes`` for ``rid``."""

    rank: int
    rid: str
    image_hashes: list[str]


@dataclass
class TPEngineWrite:
    """Prefill TP rank 0 -> other ranks (``--kv-transfer nixl|mooncake``): write the KV heads this rank is the
    writer of, of the first ``n_tokens`` tokens in its pool's ``src_pages``, into ``dst_pages`` of each decode
    rank's pool in ``regions`` that holds any of them (:func:`epdserve.kvcache.engine_copies.page_copies`) and,
    for a hybrid model, its DeltaNet heads of state slot ``src_slot`` into slot ``dst_slot`` of each region's
    state pool that holds any of them (:func:`epdserve.kvcache.state_copies.state_copies`); report with
    ``TPEngineWriteDone`` under ``room``. Sent after the forward that computed the KV."""

    room: int
    src_pages: list[int]
    n_tokens: int
    regions: list[KVEngineRegion]
    dst_pages: list[int]
    src_slot: int = -1
    dst_slot: int = -1


@dataclass
class TPEngineCancel:
    """Prefill TP rank 0 -> other ranks: give up the write of ``room`` (its request ended); no report follows."""

    room: int


@dataclass
class TPEngineWriteDone:
    """TP rank ``rank`` -> rank 0: every write of ``room`` this rank started has ended, ``nbytes`` of KV and
    ``state_bytes`` of state written, or failed (``error`` set; the writes that did not fail ended too, so none
    still lands in the decode pages)."""

    rank: int
    room: int
    nbytes: int
    error: str = ""
    state_bytes: int = 0
