"""Which linear-attention state slot each request of a prefill or decode scheduler holds (hybrid models such as
Qwen3.5), and the state half of the prefill -> decode hand-off.

A scheduler keys its requests by bootstrap room; a request takes a slot when it is admitted (beside its KV pages)
and gives it back wherever it gives its pages back (finish, abort, failed forward, deadline, acknowledged
hand-off). For models without linear-attention layers (no state pool) every method is a no-op and
:attr:`StateSlots.enabled` is False, so the schedulers call them unconditionally.

Prefill's radix cache (:meth:`StateSlots.cut_match`, :meth:`StateSlots.reserve_cuts`, :meth:`StateSlots.after_chunk`,
:meth:`StateSlots.cut_chunk`): a hit on a prefix's KV pages also needs the DeltaNet state at the prefix's end, so a
match is cut back to the longest prefix with a state snapshot (:mod:`epdserve.kvcache.state_snapshots`), which
:meth:`StateSlots.acquire` then loads into the request's slot.
"""

from __future__ import annotations

import torch

from epdserve.kvcache.state_snapshots import StateSnapshots
from epdserve.wire.messages import StateHandoff


class StateSlots:
    """Request key -> state slot over the runner's :class:`~epdserve.kvcache.state_pool.StatePool` (its
    ``state_pool``; rank 0's on a TP server, whose slot ids every rank shares). One scheduler thread uses it.

    Args:
        runner: a :class:`~epdserve.engine.model_runner.ModelRunner` or
            :class:`~epdserve.engine.tp_runner.TPRunner`; hybrid runners have ``state_pool``, ``read_state``,
            ``write_state``, ``copy_state``, ``state_handles`` and ``copy_state_from``.
        snapshot_slots: prefill: how many of the pool's slots may hold prefix-cache snapshots (0: a hybrid
            model's radix cache never matches).
    """

    def __init__(self, runner, snapshot_slots: int = 0):
        self.runner = runner
        self.pool = getattr(runner, "state_pool", None)
        self._held: dict[object, int] = {}
        self._handles = None  # shared hand-off: the pool's [conv, recurrent] handles (made on first use)
        self.snapshots = None if self.pool is None else StateSnapshots(runner, snapshot_slots, runner.page_size)

    @property
    def enabled(self) -> bool:
        """Whether the model has linear-attention states (a hybrid model)."""
        return self.pool is not None

    @property
    def used(self) -> int:
        """Slots held by requests (0 without a state pool)."""
        return len(self._held)

    @property
    def cached(self) -> int:
        """Slots holding prefix-cache snapshots (prefill), evictable."""
        return len(self.snapshots) if self.snapshots is not None else 0

    @property
    def total(self) -> int:
        """Slots requests may hold (the pool's, the scratch slot aside; 0 without a state pool)."""
        return self.pool.num_slots if self.pool is not None else 0

    def acquire(self, key, prefix: list[int] = ()) -> bool:
        """Give ``key`` a slot (True), or False when every slot is held; True without a state pool. A key that
        already holds one keeps it. With a ``prefix`` (a radix key prefix :meth:`cut_match` returned) the slot
        starts from that prefix's snapshot: copied, or the snapshot's own slot when the pool has no other.

        Raises:
            RuntimeError: ``prefix`` has no snapshot.
        """
        if self.pool is None or key in self._held:
            return True
        _, snap = self.snapshots.longest(prefix, len(prefix)) if prefix else (0, None)
        if prefix and snap is None:  # cut_match promised one: a hit without its state would compute garbage
            raise RuntimeError(f"no state snapshot of the {len(prefix)}-token prefix a radix match kept")
        if self.pool.num_free == 0 and not self.snapshots.evict_one(keep=snap):
            if snap is None:
                return False
            self._held[key] = self.snapshots.take(prefix)
            return True
        self._held[key] = self.pool.alloc()
        if snap is not None:
            self.runner.copy_state(snap, self._held[key])
        return True

    def reserve(self, key) -> int | None:
        """Decode, transfer engine path: a slot held by ``key`` for the engines to write the request's state into
        (-1 without a state pool; None when every slot is held). It is not zeroed: the write fills all of it (every
        head of every layer; :meth:`check_engine_written`), and a zeroing queued on a CUDA stream could run after
        the write has landed. A failed write's slot is freed unread; a host or shared hand-off overwrites it."""
        if self.pool is None:
            return -1
        if key not in self._held:
            if self.pool.num_free == 0:
                return None
            self._held[key] = self.pool.alloc(zero=False)
        return self._held[key]

    def acquire_all(self, keys: list) -> bool:
        """:meth:`acquire` (without a prefix) for every key of ``keys``, all or none (decode's forks of one
        request); True without a state pool. Keys that already held a slot (fork 0's, reserved for a transfer
        engine's write) keep it either way."""
        new = [key for key in keys if key not in self._held]
        for i, key in enumerate(new):
            if not self.acquire(key):
                for held in new[:i]:
                    self.release(held)
                return False
        return True

    def copy_to(self, key, others: list) -> None:
        """Copy ``key``'s state into the slots of ``others`` (decode's forks of one request start from the same
        handed-off state); nothing without a state pool."""
        if self.pool is not None:
            for other in others:
                self.runner.copy_state(self._held[key], self._held[other])

    def cut_match(self, radix, key: list[int], match):
        """Prefill: a radix ``match`` of ``key`` cut back to the longest prefix with a state snapshot (hybrid
        models; the match itself for others)."""
        if self.pool is None:
            return match
        length, _ = self.snapshots.longest(key, match.length)
        return match if length == match.length else radix.match_prefix(key[:length])

    def _last_boundary(self, n: int) -> int:
        """The last page boundary inside an ``n``-token prompt (where its snapshot goes: at least one token
        after it must be computed for the first token's logits)."""
        return (n - 1) // self.runner.page_size * self.runner.page_size

    def cut_chunk(self, start: int, take: int, n: int) -> int:
        """Prefill, a one-request forward that a CUDA graph runs (graphs take no snapshot inside): ``take`` tokens
        from ``start`` of an ``n``-token prompt, cut to end at its last page boundary when it would cross it
        (hybrid models), so :meth:`after_chunk` snapshots the state there and a second forward does the rest."""
        if self.pool is None or self.snapshots.capacity <= 0:
            return take
        last = self._last_boundary(n)
        return last - start if start < last < start + take else take

    def reserve_cuts(self, chunks: list[tuple[list[int], int, int, int]]) -> list[tuple[int, int, int, list[int]]]:
        """Prefill, an eager forward: the snapshots its DeltaNet layers take on the way. ``chunks``: per request of
        the batch, ``(radix key, start, end, n)``, its chunk ``[start, end)`` of an ``n``-token prompt. A prompt's
        last page boundary strictly inside its chunk gets a snapshot slot (none when the prefix has one already,
        the cache is off or no slot can be had).

        Returns:
            ``(request index, new tokens before the cut, slot, key prefix)`` per snapshot (empty without a state
            pool): the first three are ``ForwardBatch.state_snapshots``; hand the list to :meth:`commit_cuts` once
            the forward has run, or to :meth:`drop_cuts` when it failed.
        """
        cuts = []
        if self.pool is None:
            return cuts
        for i, (key, start, end, n) in enumerate(chunks):
            cut = self._last_boundary(n)
            if start < cut < end and (slot := self.snapshots.reserve(key[:cut])) is not None:
                cuts.append((i, cut - start, slot, key[:cut]))
        return cuts

    def commit_cuts(self, cuts: list[tuple[int, int, int, list[int]]]) -> None:
        """Keep the snapshots of :meth:`reserve_cuts` (their forward has written them)."""
        for _, _, slot, prefix in cuts:
            self.snapshots.commit(prefix, slot)

    def drop_cuts(self, cuts: list[tuple[int, int, int, list[int]]]) -> None:
        """Give back the slots of :meth:`reserve_cuts` (their forward failed)."""
        for _, _, slot, _ in cuts:
            self.pool.free(slot)

    def after_chunk(self, key, prefix_key: list[int], end: int, n: int) -> None:
        """Prefill: ``key``'s chunk ended at token ``end`` of ``n``: snapshot its state there when ``end`` is a
        page boundary inside the prompt (hybrid models)."""
        if self.pool is not None and end < n and end % self.runner.page_size == 0:
            self.snapshots.save(prefix_key[:end], self._held[key])

    def load_fields(self) -> dict[str, int]:
        """The state-slot fields of a :class:`~epdserve.wire.messages.Load`."""
        return dict(state_slots_used=self.used, state_slots_total=self.total, state_slots_cached=self.cached)

    def release(self, key) -> None:
        """Give ``key``'s slot back (nothing when it holds none)."""
        slot = self._held.pop(key, None)
        if slot is not None:
            self.pool.free(slot)

    def slot(self, key) -> int:
        """``key``'s slot. Raises KeyError when it holds none."""
        return self._held[key]

    def slots(self, keys) -> list[int] | None:
        """``ForwardBatch.state_slots`` of requests ``keys`` in batch order (None without a state pool)."""
        return None if self.pool is None else [self._held[k] for k in keys]

    # ---- the hand-off ------------------------------------------------------------------------------------
    def host_handoff(self, key) -> StateHandoff | None:
        """Prefill, host path: ``key``'s whole state read out to the CPU (the slot stays held; release it with
        the pages). None without a state pool."""
        if self.pool is None:
            return None
        conv, rec = self.runner.read_state(self._held[key])
        return StateHandoff(conv=conv, recurrent=rec)

    def shared_handoff(self, key) -> StateHandoff | None:
        """Prefill, shared path: the pool's handles and ``key``'s slot (held until the decode server's ``KVAck``,
        with the pages). None without a state pool."""
        if self.pool is None:
            return None
        if self._handles is None:
            self._handles = self.runner.state_handles()
        conv_pool, rec_pool = self._handles
        return StateHandoff(conv_pool=conv_pool, recurrent_pool=rec_pool, slot=self._held[key])

    def check_handoff(self, state: StateHandoff | None, shared: bool) -> str | None:
        """Decode: why a transfer's ``state`` cannot be loaded (missing for a hybrid model, present for another,
        wrong shapes, or the wrong path's fields), or None."""
        if self.pool is None:
            return None if state is None else "the KV transfer carries a linear-attention state this model lacks"
        if state is None:
            return "the KV transfer lacks the linear-attention state of this hybrid model"
        if shared:
            return None if state.conv_pool is not None and state.recurrent_pool is not None and state.slot >= 0 \
                else "a shared KV transfer without its state pool handles and slot"
        from epdserve.engine.state_io import state_shapes

        want = state_shapes(self.runner.config)
        got = (None if state.conv is None else tuple(state.conv.shape),
               None if state.recurrent is None else tuple(state.recurrent.shape))
        return None if got == want else f"linear-attention state has shapes {got}, expected {want}"

    def check_engine_written(self, nbytes: int) -> str | None:
        """Decode: why a transfer engine's write of ``nbytes`` bytes of state into a reserved slot is not one
        whole request state (every DeltaNet head of every layer, once), or None; a model without a state pool
        takes none."""
        if self.pool is None:
            return None if nbytes == 0 else "the KV transfer carries a linear-attention state this model lacks"
        from epdserve.engine.state_io import state_shapes

        conv, rec = state_shapes(self.runner.config)
        want = torch.Size(conv).numel() * self.pool.conv_buffer.element_size() + \
            torch.Size(rec).numel() * self.pool.recurrent_buffer.element_size()
        return None if nbytes == want else f"the transfer engines wrote {nbytes} bytes of linear-attention state, " \
                                           f"expected {want} (every DeltaNet head of every layer)"

    def load(self, key, state: StateHandoff | None, peer_pools=None) -> None:
        """Decode: load a checked ``state`` into ``key``'s slot: written from the message (host path) or copied
        out of the prefill pool that ``peer_pools`` (:class:`~epdserve.kvcache.kv_share.PeerPools`) maps
        (shared path; queued on the current stream, before the caller records the copy's event). Nothing
        without a state pool.

        Raises:
            ValueError, RuntimeError: the peer pool cannot be mapped or does not match (shared path).
        """
        if self.pool is None:
            return
        slot = self._held[key]
        if state.conv_pool is not None:
            self.runner.copy_state_from(peer_pools.tensor(state.conv_pool), peer_pools.tensor(state.recurrent_pool),
                                        state.slot, slot)
        else:
            self.runner.write_state(slot, state.conv, state.recurrent)


def state_bytes(state: StateHandoff | None) -> int:
    """Bytes of the state tensors a hand-off carries (0 for the shared path or no state)."""
    if state is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (state.conv, state.recurrent) if isinstance(t, torch.Tensor))
