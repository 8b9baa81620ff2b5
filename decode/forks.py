"""The ``n`` choices of one decode request: forks that share the prompt's KV pages.

A request of ``n`` choices is prefilled once; decode gives it ``n`` sequences (forks). The prompt's full pages
(``prompt_len // page_size`` of them) hold the same KV for every fork and are never written again (a fork writes
only at positions past the prompt), so the forks share them: one copy in the pool, held by a :class:`ForkGroup`
whose count of live forks frees them when the last fork ends (finish, abort, failure). The prompt's partial last
page would be written by each fork's own tokens, so it is copy-on-write taken to its limit: each fork gets its own
copy of it at admission, with its own pages for the rest of its output. For hybrid models (Qwen3.5) each fork
also gets its own linear-attention state slot, a copy of the handed-off state.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from epdserve.kvcache.page_pool import PagePool


class ForkGroup:
    """The prompt pages shared by the live forks of one request.

    Args:
        pages: the shared page ids (the prompt's full pages; may be empty).
        live: forks holding them.
    """

    def __init__(self, pages: list[int], live: int):
        self.pages, self.live = pages, live

    def release(self) -> list[int]:
        """One fork has ended: the pages to free now (all of them once no fork is left, else none)."""
        self.live -= 1
        if self.live > 0:
            return []
        pages, self.pages = self.pages, []
        return pages


def fork_pages(pool: PagePool, prompt_len: int, total: int, n: int) -> tuple[int, int]:
    """``(shared, own)``: the pages ``n`` forks of a ``prompt_len``-token prompt share (its full pages) and the
    pages each fork needs of its own to reach ``total`` tokens (prompt + its output); the request needs
    ``shared + n * own`` pages in all."""
    shared = prompt_len // pool.page_size
    return shared, pool.pages_for(total) - shared


def fork_copy_plan(pool: PagePool, page_tables: list[list[int]], prompt_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the handed-off prompt KV goes for forks with ``page_tables`` (fork 0 first; all share the prompt's
    full pages): ``(token index [K] int64 into the prompt, destination KV slot [K] int64)``. Fork 0 takes every
    prompt token; each other fork only the tokens of the partial last page (its own copy of that page), so one
    gather from the source fills every fork."""
    start = prompt_len // pool.page_size * pool.page_size
    idx = list(range(prompt_len))
    slots = pool.slots(page_tables[0], 0, prompt_len)
    for table in page_tables[1:]:
        idx += range(start, prompt_len)
        slots += pool.slots(table, start, prompt_len)
    return torch.tensor(idx, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def make_forks(seq, shared: int, own: int, pool: PagePool) -> list:
    """``seq`` (a scheduler's request state, fork 0) and its other forks (``n > 1``), each with the ``shared``
    prompt pages then ``own`` pages of its own, and its own grammar state (a started matcher of the same grammar).
    Pages reserved at arrival (``seq.pages``, the engine path: the prompt's full pages, then each fork's own) are
    used instead of new ones from ``pool``."""
    reserved = seq.pages
    take = (lambda k, at: reserved[at:at + k]) if reserved else (lambda k, at: pool.alloc(k))
    group = ForkGroup(take(shared, 0), seq.msg.sampling.n)
    forks = [seq] + [replace(seq, index=i, output_ids=[], transfer=None,
                             constraint=seq.constraint and seq.constraint.fork())
                     for i in range(1, seq.msg.sampling.n)]
    for i, f in enumerate(forks):
        f.group, f.shared, f.pages = group, shared, group.pages + take(own, shared + i * own)
    return forks
