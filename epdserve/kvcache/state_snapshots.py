"""Prefix-cache support for hybrid models (Qwen3.5): snapshots of the linear-attention state at page-aligned
prefix lengths, so that a radix-cache hit on a prefix's KV pages also finds the DeltaNet state at its end.

The design follows SGLang's ``MambaRadixCache`` (python/sglang/srt/mem_cache/mamba_radix_cache.py): the KV pages of
the attention layers stay in the ordinary radix tree, and a recurrent state is kept beside it only at some prefix
ends, with its own LRU eviction; a match is usable only up to the longest prefix that has both its pages and a
state. Where SGLang keeps the state on the tree nodes, these snapshots are keyed by the radix key prefix itself
(token ids, image tokens replaced by their image's pad id), so the tree needs no change: the scheduler matches the
pages, looks up the longest snapshot within the match, and cuts the match there.

Snapshots are taken where a prefill chunk ends on a page boundary (the prefill scheduler also ends a hybrid
request's last-but-one chunk at the prompt's last page boundary, so that every prompt leaves one), copied device
to device into slots of the same :class:`~epdserve.kvcache.state_pool.StatePool` as the requests' states.
Requests come first: when the pool has no free slot for a request, the least recently used snapshot goes.
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
        if self.capacity <= 0 or not key_prefix or len(key_prefix) % self.page_size:
            return
        key = tuple(key_prefix)
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        if len(self._lru) >= self.capacity or self.pool.num_free == 0:
            self.evict_one()
        if self.pool.num_free == 0:
            return
        slot = self.pool.alloc()
        self.runner.copy_state(src_slot, slot)
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
