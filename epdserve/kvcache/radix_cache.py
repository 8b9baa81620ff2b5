"""Page-granular radix (prefix) cache: token-id prefixes -> KV pages shared between requests.

Algorithm: RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs",
arXiv:2312.07104), paged as in SGLang's ``radix_cache.py`` and mini-sglang's ``kvcache``: edges hold whole pages,
so a match always ends on a page boundary and a shared page is never partially overwritten.

Image tokens take part: the prefill scheduler puts a pad id derived from the image hash at each image-token
position of the key, so the same image at the same place shares KV and a different image never does.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, Sequence


class MatchResult(NamedTuple):
    """``pages`` hold the first ``length`` tokens of the key (``length`` is a multiple of the page size);
    ``node`` is the deepest matched node, to :meth:`RadixCache.lock` while the pages are in use."""

    pages: list[int]
    length: int
    node: "_Node"


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "_Node | None"):
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    """A radix tree over token ids whose edges carry KV page ids (``page_size`` tokens per page).

    Ownership: pages inside the tree belong to the tree; :meth:`evict` hands pages back to the caller, who
    returns them to its :class:`~epdserve.kvcache.page_pool.PagePool`. Not thread-safe.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = _Node((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.num_pages = 0

    def _page_key(self, key: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(key[start:start + self.page_size])

    def _common_pages(self, node_key: tuple[int, ...], key: Sequence[int], start: int) -> int:
        ps, n = self.page_size, 0
        limit = min(len(node_key), len(key) - start) // ps
        while n < limit and node_key[n * ps:(n + 1) * ps] == tuple(key[start + n * ps:start + (n + 1) * ps]):
            n += 1
        return n

    def _split(self, node: _Node, n_pages: int) -> _Node:
        """Split ``node`` after ``n_pages`` pages; returns the new upper node (which keeps node's lock_ref)."""
        cut = n_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:n_pages], node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``key``, rounded down to whole pages. Touches the matched path (LRU);
        may split a node, never changes which pages are cached."""
        node, pages, i = self.root, [], 0
        now = next(self._clock)
        while len(key) - i >= self.page_size:
            child = node.children.get(self._page_key(key, i))
            if child is None:
                break
            n = self._common_pages(child.key, key, i)
            if n * self.page_size < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            i += n * self.page_size
            node = child
        return MatchResult(pages, i, node)

    def insert(self, key: Sequence[int], pages: list[int]) -> int:
        """Cache ``pages`` as the KV of ``key`` (``len(key) == len(pages) * page_size``).

        Returns the number of leading tokens that were already cached: the caller still owns (and must free)
        its pages for that part, ``pages[:returned // page_size]``; the tree takes ownership of the rest.

        Raises:
            ValueError: ``key`` and ``pages`` lengths disagree.
        """
        if len(key) != len(pages) * self.page_size:
            raise ValueError(f"key of {len(key)} tokens does not fill {len(pages)} pages of {self.page_size}")
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(key):
            child = node.children.get(self._page_key(key, i))
            if child is None:
                leaf = _Node(tuple(key[i:]), pages[i // self.page_size:], node)
                leaf.last_access = now
                node.children[self._page_key(key, i)] = leaf
                self.num_pages += len(leaf.pages)
                break
            n = self._common_pages(child.key, key, i)
            if n * self.page_size < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            i += n * self.page_size
            node = child
        return min(i, len(key))

    def lock(self, node: _Node) -> None:
        """Protect ``node`` and its ancestors from eviction (a request uses their pages)."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        """Undo one :meth:`lock`. Raises RuntimeError if the node is not locked."""
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            node = node.parent

    def evictable_pages(self) -> int:
        """Pages that :meth:`evict` could free now (in nodes no request holds)."""
        return sum(len(n.pages) for n in self._nodes() if n.lock_ref == 0)

    def evict(self, num_pages: int) -> list[int]:
        """Remove least-recently-used unlocked leaves until at least ``num_pages`` pages are freed (or nothing
        evictable is left). Returns the freed page ids; the caller returns them to the page pool."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(leaves)
            freed.extend(leaf.pages)
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self.num_pages -= len(freed)
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Assert the tree's invariants (for tests): whole-page edges, children keyed by their first page,
        locks never larger below than above, every page in exactly one node, and ``num_pages`` correct.

        Raises:
            AssertionError: an invariant is broken.
        """
        seen: set[int] = set()
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.pages) * self.page_size, "edge is not whole pages"
            assert node.parent.children.get(self._page_key(node.key, 0)) is node, "child keyed wrongly"
            assert 0 <= node.lock_ref <= node.parent.lock_ref, "lock count below exceeds above"
            assert not seen.intersection(node.pages), "a page sits in two nodes"
            seen.update(node.pages)
        assert len(seen) == self.num_pages, f"num_pages {self.num_pages} != {len(seen)} pages in the tree"
