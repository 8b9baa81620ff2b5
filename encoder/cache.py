"""LRU cache of image embeddings keyed by the image's SHA-256, bounded in bytes.

The same image (a chat history resent every turn, a popular picture) is then encoded once per server.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedEmbedding:
    """One cached image: ``embedding`` is ``[num_tokens, hidden_size]`` (CPU), ``grid_thw`` the processor's grid."""

    embedding: torch.Tensor
    grid_thw: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this entry holds."""
        return self.embedding.numel() * self.embedding.element_size()


class EmbeddingCache:
    """Least-recently-used map ``image_hash -> CachedEmbedding`` holding at most ``capacity_bytes`` of tensors.

    An entry larger than the whole capacity is not stored (``capacity_bytes == 0`` disables the cache).
    Not thread-safe: use it from one thread (the server's event loop).

    Attributes:
        hits, misses: counts of :meth:`get` calls that found / did not find their key.
    """

    def __init__(self, capacity_bytes: int) -> None:
        """Raises: ValueError: ``capacity_bytes < 0``."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, CachedEmbedding] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """Membership test; does not count as a hit or a miss and does not refresh the entry."""
        return key in self._entries

    @property
    def size_bytes(self) -> int:
        """Bytes of tensor data currently held."""
        return self._size

    def get(self, key: str) -> CachedEmbedding | None:
        """The entry for ``key`` (now the most recently used), or None; counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def put(self, key: str, embedding: torch.Tensor, grid_thw: list[int]) -> bool:
        """Store (or replace) ``key``, evicting least recently used entries until it fits.

        Returns False, storing nothing, when the entry alone is larger than the capacity.
        """
        entry = CachedEmbedding(embedding, list(grid_thw))
        if entry.nbytes > self.capacity_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self._size -= old.nbytes
        while self._entries and self._size + entry.nbytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._size -= evicted.nbytes
        self._entries[key] = entry
        self._size += entry.nbytes
        return True

    def stats(self) -> dict[str, int]:
        """``{"entries", "size_bytes", "capacity_bytes", "hits", "misses"}``."""
        return {"entries": len(self._entries), "size_bytes": self._size, "capacity_bytes": self.capacity_bytes,
                "hits": self.hits, "misses": self.misses}
