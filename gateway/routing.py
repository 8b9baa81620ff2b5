"""Which of several prefill and decode servers takes a request (issue 48: data-parallel stages behind one gateway).

Prefill is chosen cache-aware, by the rule of SGLang's model gateway (smg, ``src/policies/cache_aware.rs``):

- the servers are *imbalanced* when both ``max(load) - min(load) > balance_abs_threshold`` and
  ``max(load) > balance_rel_threshold * min(load)``; then the least loaded takes the request;
- otherwise the server whose approximate radix tree holds the longest prefix of the prompt takes it, if that
  prefix is more than ``cache_threshold`` of the prompt; else the server with the smallest tree (the most cache
  room), so new prompts spread.

The approximate trees are the gateway's own record of what it sent where (a :class:`RadixCache` per server over
the prompt's token ids, image tokens keyed by their image's hash as the prefill server keys them), not a query of
the servers: what a server evicted stays here until this tree evicts it too (least recently used, past
``max_pages`` pages). smg keeps its trees over raw text; here the gateway has the token ids already.

Decode is chosen by load: the fewest running requests, then the most free KV pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epdserve.kvcache.radix_cache import RadixCache


@dataclass(frozen=True)
class CacheAwareConfig:
    """smg's ``cache_aware`` knobs, with its defaults (``--cache-threshold``, ``--balance-abs-threshold``,
    ``--balance-rel-threshold``); ``max_pages``: the largest tree kept per server, in pages of ``page_size``
    tokens (smg: ``--max-tree-size``, in nodes)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    page_size: int = 16
    max_pages: int = 1 << 16


def imbalanced(loads: Sequence[int], abs_threshold: int, rel_threshold: float) -> bool:
    """smg's test: both the absolute and the relative gap between the most and the least loaded exceed theirs."""
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


class PrefillRouter:
    """Chooses a prefill server per prompt (module docstring) and records where each prompt went.

    Args:
        num_servers: the prefill servers, by index.
        config: the rule's knobs.
    """

    def __init__(self, num_servers: int, config: CacheAwareConfig = CacheAwareConfig()):
        if num_servers < 1:
            raise ValueError(f"need at least one prefill server, got {num_servers}")
        self.config = config
        self.trees = [RadixCache(config.page_size) for _ in range(num_servers)]

    def choose(self, key: Sequence[int], loads: Sequence[int], up: Sequence[bool] | None = None) -> int:
        """The server for a prompt whose radix key is ``key`` (token ids, image tokens as their hash pad ids).

        Args:
            loads: each server's load (requests waiting and running), by index.
            up: which servers may take it (default all).

        Raises:
            ValueError: no server is up.
        """
        cands = [i for i in range(len(self.trees)) if up is None or up[i]]
        if not cands:
            raise ValueError("no prefill server is up")
        cfg = self.config
        if len(cands) > 1 and imbalanced([loads[i] for i in cands], cfg.balance_abs_threshold,
                                         cfg.balance_rel_threshold):
            return min(cands, key=lambda i: (loads[i], i))
        matched = {i: self.trees[i].match_prefix(key).length for i in cands}
        best = max(cands, key=lambda i: (matched[i], -loads[i], -i))
        if key and matched[best] / len(key) > cfg.cache_threshold:
            return best
        return min(cands, key=lambda i: (self.trees[i].num_pages, loads[i], i))

    def record(self, server: int, key: Sequence[int]) -> None:
        """Note that ``server`` now caches ``key``'s whole pages; evict that tree's least recently used part past
        ``max_pages``."""
        tree, ps = self.trees[server], self.config.page_size
        n = len(key) // ps
        if n:
            tree.insert(key[:n * ps], [0] * n)  # page ids do not matter here: only what is cached where
        if tree.num_pages > self.config.max_pages:
            tree.evict(tree.num_pages - self.config.max_pages)

    def forget(self, server: int) -> None:
        """Drop what ``server`` was thought to cache (it restarted or went down)."""
        self.trees[server] = RadixCache(self.config.page_size)


def choose_decode(running: Sequence[int], free_pages: Sequence[int], up: Sequence[bool] | None = None) -> int:
    """The decode server with the fewest running requests, then the most free KV pages, then the lowest index.

    Raises:
        ValueError: no server is up.
    """
    cands = [i for i in range(len(running)) if up is None or up[i]]
    if not cands:
        raise ValueError("no decode server is up")
    return min(cands, key=lambda i: (running[i], -free_pages[i], i))
