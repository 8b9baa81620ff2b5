"""The gateway's choice among several prefill and decode servers (gateway/routing.py): smg's cache_aware rule for
prefill over the gateway's approximate radix trees, load for decode."""

from __future__ import annotations

import random

import pytest

from epdserve.gateway.routing import CacheAwareConfig, PrefillRouter, choose_decode, imbalanced

PAGE = 16


def _prompt(seed: int, n: int = 200, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    return (prefix or []) + [rng.randrange(10, 50_000) for _ in range(n)]


def test_repeated_prompts_and_shared_prefixes_return_to_their_server():
    router = PrefillRouter(3, CacheAwareConfig(page_size=PAGE))
    loads = [0, 0, 0]
    placed = {}
    for seed in range(6):  # six new prompts spread over the three (smallest tree first)
        key = _prompt(seed)
        placed[seed] = router.choose(key, loads)
        router.record(placed[seed], key)
    assert sorted(placed.values()) == [0, 0, 1, 1, 2, 2]
    for seed in range(6):  # the same prompt again, and a follow-up turn that extends it
        assert router.choose(_prompt(seed), loads) == placed[seed]
        assert router.choose(_prompt(seed) + _prompt(100 + seed, 40), loads) == placed[seed]
    # A prompt sharing only a short prefix (under the 0.3 threshold) goes by tree size, not by the match.
    short = _prompt(0, 40) + _prompt(200, 400)
    assert router.choose(short, loads) == min(range(3), key=lambda i: (router.trees[i].num_pages, i))


def test_imbalanced_load_overrides_the_cache():
    router = PrefillRouter(2, CacheAwareConfig(page_size=PAGE, balance_abs_threshold=8, balance_rel_threshold=1.5))
    key = _prompt(1)
    router.record(0, key)
    assert router.choose(key, [5, 0]) == 0  # a gap of 5 is within the absolute threshold
    assert router.choose(key, [20, 0]) == 1  # 20 - 0 > 8 and 20 > 1.5 * 0
    assert router.choose(key, [30, 25]) == 0  # 5 apart: balanced, the cache decides
    assert imbalanced([100, 10], 64, 1.5) and not imbalanced([100, 80], 64, 1.5) and not imbalanced([70, 50], 64, 1.5)


def test_down_servers_are_skipped_and_forgotten_ones_start_empty():
    router = PrefillRouter(2, CacheAwareConfig(page_size=PAGE))
    key = _prompt(2)
    router.record(1, key)
    assert router.choose(key, [0, 0]) == 1
    assert router.choose(key, [0, 0], up=[True, False]) == 0
    router.forget(1)
    assert router.trees[1].num_pages == 0
    with pytest.raises(ValueError, match="no prefill server is up"):
        router.choose(key, [0, 0], up=[False, False])


def test_each_tree_is_bounded():
    router = PrefillRouter(1, CacheAwareConfig(page_size=PAGE, max_pages=50))
    for seed in range(10):
        router.record(0, _prompt(seed, 16 * 12))  # 12 pages each
    assert router.trees[0].num_pages <= 50
    assert router.trees[0].match_prefix(_prompt(9, 16 * 12)).length == 16 * 12  # the newest stays
    assert router.trees[0].match_prefix(_prompt(0, 16 * 12)).length == 0  # the oldest went


def test_decode_by_running_requests_then_free_pages():
    assert choose_decode([3, 1, 1], [10, 5, 9]) == 2
    assert choose_decode([0, 0], [7, 7]) == 0
    assert choose_decode([0, 5], [7, 7], up=[False, True]) == 1
    with pytest.raises(ValueError, match="no decode server is up"):
        choose_decode([0], [1], up=[False])
