"""Which linear-attention state slot each request of a prefill or decode scheduler holds (hybrid models such as
Qwen3.5), and the state half of the prefill -> decode hand-off.

A scheduler keys its requests by bootstrap room; a request takes a slot when it is admitted (beside its KV pages)
and gives it back wherever it gives its pages back (finish, abort, failed forward, deadline, acknowledged
hand-off). For models without linear-attention layers (no state pool) every method is a no-op and
:attr:`StateSlots.enabled` is False, so the schedulers call them unconditionally.
"""

from __future__ import annotations

import torch

from epdserve.wire.messages import StateHandoff


class StateSlots:
    """Request key -> state slot over the runner's :class:`~epdserve.kvcache.state_pool.StatePool` (its
    ``state_pool``; rank 0's on a TP server, whose slot ids every rank shares). One scheduler thread uses it.

    Args:
        runner: a :class:`~epdserve.engine.model_runner.ModelRunner` or
            :class:`~epdserve.engine.tp_runner.TPRunner`; hybrid runners have ``state_pool``, ``read_state``,
            ``write_state``, ``state_handles`` and ``copy_state_from``.
    """

    def __init__(self, runner):
        self.runner = runner
        self.pool = getattr(runner, "state_pool", None)
        self._held: dict[object, int] = {}
        self._handles = None  # shared hand-off: the pool's [conv, recurrent] handles (made on first use)
        self.snapshots = None  # prefill: its StateSnapshots, which give up slots to requests (acquire)

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

    def acquire(self, key) -> bool:
        """Give ``key`` a slot (True), or False when every slot is held; True without a state pool. A key that
        already holds one keeps it."""
        if self.pool is None or key in self._held:
            return True
        if self.pool.num_free == 0 and (self.snapshots is None or not self.snapshots.evict_one()):
            return False
        self._held[key] = self.pool.alloc()
        return True

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
