"""Bytes a prefill -> decode hand-off (``KVTransfer``) moves, by path, for the LM stages' metrics
(:mod:`epdserve.metrics`): prompt KV and a hybrid model's linear-attention state, in the message, lent from a
mapped pool, or written by a transfer engine."""

from __future__ import annotations

import math
from typing import Any

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def kv_transfer_bytes(transfer: Any) -> int:
    """Bytes of KV a ``KVTransfer`` hands off: its ``kv`` tensor (host path), or the whole pages it lends from the
    prefill pool (shared path: ``kv_pages`` of the ``pool`` handle's page size), or the bytes a transfer engine
    wrote (``engine_bytes``); 0 for an error."""
    if getattr(transfer, "engine_written", False):
        return transfer.engine_bytes
    if transfer.kv is not None:
        return transfer.kv.numel() * transfer.kv.element_size()
    pool = getattr(transfer, "pool", None)
    if pool is None or not transfer.kv_pages:
        return 0
    layers, kv, _, page_size, heads, head_dim = pool.shape
    return len(transfer.kv_pages) * layers * kv * page_size * heads * head_dim * _ITEMSIZE.get(pool.dtype, 2)


def state_transfer_bytes(transfer: Any) -> int:
    """Bytes of linear-attention state a hybrid model's ``KVTransfer`` hands off (``transfer.state``, a
    ``StateHandoff``): its ``conv`` and ``recurrent`` tensors (host path), or one slot of each pool it lends
    (shared path: ``[layers, slots + 1, ...]`` handles, one slot's ``layers * prod(shape[2:])`` elements); 0 for
    none. A transfer engine's state writes count too (``engine_state_bytes``)."""
    state = getattr(transfer, "state", None)
    if state is None:
        return getattr(transfer, "engine_state_bytes", 0) if getattr(transfer, "engine_written", False) else 0
    if state.conv is not None and state.recurrent is not None:
        return sum(t.numel() * t.element_size() for t in (state.conv, state.recurrent))
    total = 0
    for pool in (state.conv_pool, state.recurrent_pool):
        if pool is not None:
            total += math.prod([pool.shape[0], *pool.shape[2:]]) * _ITEMSIZE.get(pool.dtype, 2)
    return total
