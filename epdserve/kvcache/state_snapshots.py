"""Prefix-cache support for hybrid models (Qwen3.5): snapshots of the linear-attention state at page-aligned
prefix lengths, so that a radix-cache hit on a prefix's KV pages also finds the DeltaNet state at its end.

The design follows SGLang's ``MambaRadixCache`` (python/sglang/srt/mem_cache/mamba_radix_cache.py): the KV pages of
the attention layers stay in the ordinary radix tree, and a recurrent state is kept beside it only at some prefix
ends, with its own LRU eviction; a match is usable only up to the longest prefix that has both its pages and a
state. Where SGLang keeps the state on the tree nodes, these snapshots are keyed by the radix key prefix itself
(token ids, image tokens replaced by their image's pad id), so the tree needs no change: the scheduler matches the
pages, looks up the longest snapshot within the match, and cuts the match there.

Every prompt leaves a snapshot at its last page boundary. Where a prefill forward crosses that boundary, the
DeltaNet layers write the state there into a slot reserved here (:meth:`StateSnapshots.reserve`, then
:meth:`StateSnapshots.commit` after the forward; ``ForwardBatch.state_snapshots``); a one-request prefill that a
CUDA graph runs is cut there into two forwards instead, and a chunk that ends on a page boundary is copied device to
device after its forward (:meth:`StateSnapshots.save`). The slots are of the same
:class:`~epdserve.kvcache.state_pool.StatePool` as the requests' states. Requests come first: when the pool has no
free slot for a request, the least recently used snapshot goes.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """Up to ``capacity`` state snapshots, LRU, keyed by radix key prefix (lengths multiples of ``page_size``).

    Args:
        runner: a hybrid model's runner (``state_pool``, ``copy_state(src_slot, dst_slot)``, on every TP rank).
        capacity: most snapshots kept (0: none are taken and nothing ever matches).
        page_size: the KV page size (snapshot lengths are multiples of it).

    Lookups hash each candidate prefix, ``O(length)`` per page-aligned length that holds a snapshot: cheap next
    to the prefill it saves.
    """

    def __init__(self, runner, capacity: int, page_size: int):
        self.runner, self.pool, self.capacity, self.page_size = runner, runner.state_pool, capacity, page_size
        self._lru: OrderedDict[tuple[int, ...], int] = OrderedDict()  # key prefix -> slot, oldest first
        self._lengths: dict[int, int] = {}  # prefix length -> snapshots of that length

    def __len__(self) -> int:
        return len(self._lru)

    def save(self, key_prefix: list[int], src_slot: int) -> None:
        """Snapshot ``src_slot``'s state as the state after ``key_prefix`` (a page-aligned length); evicts the
        least recently used snapshot when at ``capacity`` or when the pool has no free slot (requests hold the
        rest); nothing when ``capacity`` is 0 or no slot can be had."""
        slot = self.reserve(key_prefix)
        if slot is not None:
            self.runner.copy_state(src_slot, slot)
            self.commit(key_prefix, slot)

    def reserve(self, key_prefix: list[int]) -> int | None:
        """A slot to write the state after ``key_prefix`` (a page-aligned length) into, held until :meth:`commit`
        (or ``pool.free`` when the write never happens); None when no snapshot is wanted: ``capacity`` 0, a snapshot
        of it exists already (touched: most recently used now), or no slot can be had (the least recently used
        snapshot is evicted first when at ``capacity`` or when the pool has no free slot)."""
        if self.capacity <= 0 or not key_prefix or len(key_prefix) % self.page_size:
            return None
        key = tuple(key_prefix)
        if key in self._lru:
            self._lru.move_to_end(key)
            return None
        if len(self._lru) >= self.capacity or self.pool.num_free == 0:
            self.evict_one()
        return self.pool.alloc() if self.pool.num_free else None

    def commit(self, key_prefix: list[int], slot: int) -> None:
        """Keep ``slot`` (from :meth:`reserve`, now written) as the snapshot of ``key_prefix``; freed instead when
        another request's snapshot of the same prefix got there first."""
        key = tuple(key_prefix)
        if key in self._lru:
            self.pool.free(slot)
            return
        self._lru[key] = slot
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1

    def longest(self, key: list[int], limit: int) -> tuple[int, int | None]:
        """``(length, slot)`` of the longest snapshot of a prefix of ``key`` no longer than ``limit`` tokens
        (touched: most recently used now), or ``(0, None)``."""
        for length in sorted((n for n in self._lengths if n <= limit), reverse=True):
            slot = self._lru.get(tuple(key[:length]))
            if slot is not None:
                self._lru.move_to_end(tuple(key[:length]))
                return length, slot
        return 0, None

    def evict_one(self, keep: int | None = None) -> bool:
        """Free the least recently used snapshot's slot other than slot ``keep``; False when there is none."""
        victim = next((k for k, slot in self._lru.items() if slot != keep), None)
        if victim is None:
            return False
        self.pool.free(self.take(list(victim)))
        return True

    def take(self, key_prefix: list[int]) -> int:
        """Remove the snapshot of ``key_prefix`` and hand over its slot (still allocated: the caller owns it now).

        Raises:
            KeyError: no snapshot of ``key_prefix``.
        """
        key = tuple(key_prefix)
        slot = self._lru.pop(key)
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        return slot
