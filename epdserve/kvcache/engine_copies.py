"""What a transfer engine write moves (``--kv-transfer nixl|mooncake``): the ``(source address, peer address,
bytes)`` descriptors that carry a prompt's KV pages from one TP rank's pool into one decode rank's pool, whatever
the TP sizes of the two servers.

Every pool is ``[L, 2, pages, page_size, H, D]`` with ``H`` the KV heads its rank holds (from ``head_start`` on, of
the model's ``num_kv_heads``); both servers' ranks address the same page ids (one scheduler per server). Heads are
paired as SGLang's Mooncake/NIXL connectors pair them for different TP sizes (``send_kvcache_slice``): each prefill
rank writes the KV heads it is the writer of (:func:`writer_heads`) into every decode rank that holds any of them,
one write per rank pair. So TP 2 -> 1 is two writes (each prefill rank half of the heads into decode rank 0's
pages) and 1 -> 2 too (prefill rank 0 gives each decode rank its half).

Layout choice: a token's KV heads are contiguous in a page (``[page_size, H, D]``), so when a rank pair moves every
head of both pools (equal TP) a run of pages is one descriptor per layer and K/V; when it moves part of a pool's
heads (different TP) each token's head slice is its own descriptor (``L * 2 * n_tokens`` descriptors, as SGLang's
per-token slices). We keep the attention layout rather than make pools head-major (``[L, 2, H, pages, ...]``,
where a head slice of a page would be contiguous): FlashInfer could read that (``HND``), but the runner's KV
writes, its SDPA path and its CUDA graphs all read ``[pages, page_size, H, D]``; the per-token descriptors are built
vectorised here and batched by the engines (slow all the same: docs/performance.md).
"""

from __future__ import annotations

import torch

from epdserve.wire.codec import FLOAT_DTYPE_NAMES
from epdserve.wire.messages import KVEngineRegion

Copies = list[tuple[int, int, int]]


def writer_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(first KV head, count)`` that prefill TP rank ``rank`` of ``tp_size`` writes: the KV heads it holds
    (:func:`epdserve.models.parallel.head_shard`) that no lower rank holds, so a KV head replicated over ranks (a
    model with fewer KV heads than ranks) is written once, by its first holder; count 0 for the other holders.

    Raises:
        ValueError: heads that do not split over ``tp_size`` ranks.
    """
    from epdserve.engine.distributed import TPGroup
    from epdserve.models.parallel import head_shard

    def shard(r):
        return head_shard(num_heads, num_kv_heads, TPGroup(r, tp_size, torch.device("cpu")))

    mine = shard(rank)
    if rank > 0 and shard(rank - 1).kv_start == mine.kv_start:
        return mine.kv_start, 0
    return mine.kv_start, mine.num_kv_heads


def check_region(region: KVEngineRegion, buffer: torch.Tensor, pages: list[int], n_tokens: int,
                 num_kv_heads: int) -> str | None:
    """Why the prompt KV of ``n_tokens`` tokens in ``buffer`` cannot be written into ``pages`` of ``region``
    (None: it can): the pools must have one layout but for the page count and the KV heads each holds, and the
    region's heads must be some of the model's ``num_kv_heads``."""
    shape = list(buffer.shape)
    if region.dtype not in FLOAT_DTYPE_NAMES or getattr(torch, region.dtype) != buffer.dtype:
        return f"decode KV pool dtype {region.dtype} != prefill's {buffer.dtype}"
    if len(region.shape) != 6 or [*region.shape[:2], region.shape[3], region.shape[5]] != \
            [*shape[:2], shape[3], shape[5]]:
        return f"decode KV pool shape {region.shape} does not match prefill's {shape} but for pages and KV heads"
    if region.shape[4] <= 0 or not 0 <= region.head_start <= num_kv_heads - region.shape[4]:
        return f"decode KV pool holds KV heads {region.head_start}..+{region.shape[4]}, not of the model's " \
               f"{num_kv_heads}"
    if len(pages) < -(-n_tokens // shape[3]) or any(not 0 <= p < region.shape[2] for p in pages):
        return f"decode registered {len(pages)} pages (or pages out of its pool) for a {n_tokens}-token prompt"
    return None


def page_copies(buffer: torch.Tensor, src_pages: list[int], region: KVEngineRegion, dst_pages: list[int],
                n_tokens: int, *, own_start: int = 0, heads: tuple[int, int] | None = None) -> Copies:
    """The writes ``(source address, peer address, bytes)`` that move the first ``n_tokens`` tokens' KV, every
    layer's K and V, from ``src_pages`` of the pool ``buffer`` ``[L, 2, P, ps, H, D]`` (holding the model's KV
    heads from ``own_start`` on) into ``dst_pages`` of ``region`` (see :func:`check_region`): the KV heads
    ``heads`` ``(first, count)`` (default: all of ``buffer``'s) that the region holds too; none when it holds none.

    Whole pools' heads on both sides: runs of pages consecutive on both sides are one write, the last page
    written only as far as the prompt goes. Part of either pool's heads: one write per token, layer and K/V (the
    module docstring says why)."""
    L, two, P, ps, H, D = buffer.shape
    first, count = heads if heads is not None else (own_start, H)
    lo, hi = max(first, region.head_start), min(first + count, region.head_start + region.shape[4])
    if hi <= lo:
        return []
    es, Pd, Hd = buffer.element_size(), region.shape[2], region.shape[4]
    n_pages = -(-n_tokens // ps)
    if lo == own_start and hi - lo == H == Hd:
        return _page_runs(buffer, src_pages, region, dst_pages, n_tokens)
    tok = torch.arange(n_tokens, dtype=torch.int64)
    src_page = torch.tensor(src_pages[:n_pages], dtype=torch.int64)[tok // ps]
    dst_page = torch.tensor(dst_pages[:n_pages], dtype=torch.int64)[tok // ps]
    plane = torch.arange(L * two, dtype=torch.int64)[:, None]  # layer l's K is plane 2l, its V 2l + 1
    src = buffer.data_ptr() + ((plane * P + src_page) * ps + tok % ps) * H * D * es + (lo - own_start) * D * es
    dst = region.base + ((plane * Pd + dst_page) * ps + tok % ps) * Hd * D * es + (lo - region.head_start) * D * es
    nbytes = (hi - lo) * D * es
    return [(s, d, nbytes) for s, d in zip(src.flatten().tolist(), dst.flatten().tolist())]


def _page_runs(buffer: torch.Tensor, src_pages: list[int], region: KVEngineRegion, dst_pages: list[int],
               n_tokens: int) -> Copies:
    """:func:`page_copies` when both pools hold the same KV heads: whole pages, consecutive runs merged."""
    L, two, P, ps, H, D = buffer.shape
    token_bytes = H * D * buffer.element_size()
    page_bytes, peer_pages = ps * token_bytes, region.shape[2]
    n_pages = -(-n_tokens // ps)
    tail = (n_tokens - (n_pages - 1) * ps) * token_bytes
    runs = []  # (first src page, first dst page, pages, bytes of the last page)
    for i in range(n_pages):
        s, d, last = src_pages[i], dst_pages[i], tail if i == n_pages - 1 else page_bytes
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1, last)
        else:
            runs.append((s, d, 1, last))
    src_base, dst_base, out = buffer.data_ptr(), region.base, []
    for plane in range(L * two):  # layer l's K is plane 2l, its V 2l + 1
        for s, d, count, last in runs:
            out.append((src_base + (plane * P + s) * page_bytes, dst_base + (plane * peer_pages + d) * page_bytes,
                        (count - 1) * page_bytes + last))
    return out
