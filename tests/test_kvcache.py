"""Page pool and radix cache: sharing, splitting, eviction order, locking, and integrity after every step."""

import random

import pytest

from epdserve.kvcache.page_pool import OutOfPages, PagePool
from epdserve.kvcache.radix_cache import RadixCache


def test_page_pool_alloc_free_and_errors():
    pool = PagePool(4, page_size=2)
    a = pool.alloc(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(OutOfPages):
        pool.alloc(2)
    assert pool.num_free == 1  # a failed alloc changes nothing
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free([a[0]])
    assert pool.pages_for(5) == 3 and pool.pages_for(4) == 2


def test_radix_match_insert_split_share():
    r = RadixCache(page_size=2)
    assert r.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    r.check_integrity()
    m = r.match_prefix([1, 2, 3, 4, 9, 9, 7])
    assert (m.pages, m.length) == ([10, 11], 4)  # split after two pages, partial page never matched
    r.check_integrity()
    # A second sequence sharing two pages: the caller still owns its duplicate pages for them.
    assert r.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == 4
    assert r.num_pages == 4
    r.check_integrity()
    assert r.match_prefix([1, 2, 3, 4, 7, 8]).pages == [10, 11, 22]
    assert r.match_prefix([1, 3]).length == 0
    assert r.match_prefix([1]).length == 0


def test_radix_eviction_is_lru_and_respects_locks():
    r = RadixCache(page_size=1)
    r.insert([1, 2], [0, 1])
    r.insert([1, 3], [0, 2])  # shares page 0 (caller frees its duplicate)
    r.insert([5], [3])
    m = r.match_prefix([1, 3])  # touch: [5] and [1,2]'s leaf are now older
    r.lock(m.node)
    assert r.evictable_pages() == 2
    freed = r.evict(1)
    assert freed == [1]  # leaf of [1,2] is the least recently used
    r.check_integrity()
    assert sorted(r.evict(10)) == [3]  # [1] and [1,3] are locked
    r.unlock(m.node)
    assert sorted(r.evict(10)) == [0, 2]
    assert r.num_pages == 0
    r.check_integrity()
    with pytest.raises(RuntimeError):
        r.unlock(m.node)


def test_radix_random_against_reference():
    """Random inserts/matches/evictions: matches equal the longest inserted page-aligned prefix still cached."""
    rng = random.Random(0)
    ps = 2
    r = RadixCache(page_size=ps)
    pool = PagePool(200, ps)
    for _ in range(300):
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 6) * ps)]
        m = r.match_prefix(key)
        assert m.length % ps == 0 and len(m.pages) == m.length // ps
        if pool.num_free < len(key) // ps:
            pool.free(r.evict(len(key) // ps))
        new = pool.alloc(len(key) // ps - len(m.pages))
        present = r.insert(key, m.pages + new)
        assert present >= m.length
        pool.free(new[: present // ps - len(m.pages)])
        r.check_integrity()
        assert pool.num_free + r.num_pages == pool.num_pages
        assert r.match_prefix(key).length == len(key)
