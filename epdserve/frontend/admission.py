"""Admission control: a bound on the chat requests one gateway has in flight, with a bounded FIFO queue before it.

Past the bounds a request is refused at once with a ``Retry-After`` instead of queueing without limit:

- up to ``max_inflight`` requests run (encode, prefill, decode, streaming to the client);
- up to ``max_queued`` more wait, first come first served, each for at most ``queue_timeout_s`` seconds
  (then 503, "server busy");
- beyond that, 429.

The stages queue what the gateway admits (decode waits FIFO for KV pages), so these bounds are what keeps their
queues, and the KV held in them, finite.
"""

from __future__ import annotations

import asyncio
from collections import deque

RETRY_AFTER_S = 1


class Overloaded(Exception):
    """Refused by admission control; answer with HTTP ``status`` (429 or 503) and ``Retry-After: retry_after_s``."""

    def __init__(self, status: int, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


class Admission:
    """Counts requests in flight and queued; all methods run on one event loop.

    Args:
        max_inflight: requests running at once (0 = no limit).
        max_queued: requests waiting for a slot beyond those (0 = none wait: 429 at once when full).
        queue_timeout_s: longest wait for a slot, in seconds.
    """

    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float):
        self.max_inflight, self.max_queued, self.queue_timeout_s = max_inflight, max_queued, queue_timeout_s
        self.inflight = 0
        self._queue: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if all are taken. Pair every successful call with :meth:`release`.

        Raises:
            Overloaded: 429 when the queue is full, 503 when the wait passed ``queue_timeout_s``.
        """
        if self.max_inflight <= 0 or (self.inflight < self.max_inflight and not self._queue):
            self.inflight += 1
            return
        if len(self._queue) >= self.max_queued:
            raise Overloaded(429, f"too many requests: {self.inflight} in flight and {len(self._queue)} queued; "
                                  "retry later")
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except BaseException as e:
            if fut.done() and not fut.cancelled():  # the slot was handed over just as the wait ended: give it on
                self.release()
            else:
                fut.cancel()
                self._queue.remove(fut)
            if isinstance(e, TimeoutError):
                raise Overloaded(503, f"server busy: no capacity within {self.queue_timeout_s:g} s; "
                                      "retry later") from None
            raise
        # release() handed its slot to this waiter: inflight was not decremented.

    def release(self) -> None:
        """Give a slot back: to the oldest waiter if any, else free it."""
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.inflight -= 1
