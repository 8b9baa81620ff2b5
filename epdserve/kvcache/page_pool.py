"""Free list of KV page ids; the schedulers own allocation, the model runner owns the page tensors."""

from __future__ import annotations


def page_slots(pages: list[int], page_size: int, start: int, end: int) -> list[int]:
    """KV slots (``page * page_size + offset``) of tokens ``start .. end-1`` of a sequence whose KV sits in
    ``pages`` of ``page_size`` tokens, in order."""
    return [pages[i // page_size] * page_size + i % page_size for i in range(start, end)]


class OutOfPages(RuntimeError):
    """Raised by :meth:`PagePool.alloc` when fewer pages are free than asked for."""


class PagePool:
    """Hands out page ids ``0 .. num_pages-1`` of one KV pool.

    A page holds ``page_size`` consecutive tokens of one request (all layers, K and V). Not thread-safe: one
    scheduler loop owns it.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end so freshly freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def slots(self, pages: list[int], start: int, end: int) -> list[int]:
        """KV slots of tokens ``start .. end-1`` of a sequence whose KV sits in ``pages`` of this pool
        (:func:`page_slots`)."""
        return page_slots(pages, self.page_size, start, end)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages. Raises :class:`OutOfPages` (state unchanged) when fewer are free."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. Raises ValueError on a double free or an unknown page id."""
        # Pushed last-first, so a later alloc pops them in their own order: pages that were consecutive stay
        # consecutive, and a transfer engine moves such a run as one write instead of one per page (on an H100,
        # ~17k single-page NIXL writes for a 3.8k-token prompt cost ~235 ms to post; one run per plane, 0.1 ms).
        for p in reversed(pages):
            if not 0 <= p < self.num_pages or self._is_free[p]:
                raise ValueError(f"page {p} freed twice or out of range")
            self._is_free[p] = True
            self._free.append(p)
