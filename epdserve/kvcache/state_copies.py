"""What a transfer engine write moves of a hybrid model's (Qwen3.5) linear-attention state
(``--kv-transfer nixl|mooncake``): the ``(source address, peer address, bytes)`` descriptors that carry one state
slot of a prefill TP rank's :class:`~epdserve.kvcache.state_pool.StatePool` into a slot of a decode rank's, beside
the KV pages of :mod:`epdserve.kvcache.engine_copies`, whatever the TP sizes of the two servers.

A rank's pool holds its own DeltaNet heads (:func:`epdserve.models.qwen3_5_deltanet.deltanet_heads`; they split evenly,
never replicated): ``conv_buffer`` ``[layers, slots + 1, conv_dim, kernel]`` whose channels are its q | k | v
parts (q and k by key head, ``key_dim`` channels each; v by value head, ``value_dim`` each), and
``recurrent_buffer`` ``[layers, slots + 1, value_heads, key_dim, value_dim]``. A head's channels, and a value
head's recurrent state, are contiguous within a slot, so heads both ranks hold are one run per layer and part:
equal TP sizes move a slot as one conv run (the three parts merge) and one recurrent run per layer; different
sizes move each part's shared heads (SGLang registers its Mamba pools with the engine the same way and sends
the slot index at bootstrap).
"""

from __future__ import annotations

import torch

from epdserve.wire.codec import FLOAT_DTYPE_NAMES
from epdserve.wire.engine_region import StateEngineRegion

Copies = list[tuple[int, int, int]]


def describe_state(conv: torch.Tensor, recurrent: torch.Tensor, key_start: int, value_start: int) -> StateEngineRegion:
    """The region of a rank's state buffers ``conv`` ``[layers, slots + 1, conv_dim, kernel]`` and ``recurrent``
    ``[layers, slots + 1, value_heads, key_dim, value_dim]``, holding the model's DeltaNet key heads from
    ``key_start`` and value heads from ``value_start`` on.

    Raises:
        ValueError: a buffer not contiguous (an engine registers, and addresses, whole buffers).
    """
    if not (conv.is_contiguous() and recurrent.is_contiguous()):
        raise ValueError("state buffers must be contiguous to be registered")
    return StateEngineRegion(conv_base=conv.data_ptr(), conv_shape=list(conv.shape),
                             conv_dtype=str(conv.dtype).removeprefix("torch."), recurrent_base=recurrent.data_ptr(),
                             recurrent_shape=list(recurrent.shape),
                             recurrent_dtype=str(recurrent.dtype).removeprefix("torch."), key_start=key_start,
                             value_start=value_start)


def _sizes(r: StateEngineRegion) -> tuple[int, int, int, int, int]:
    """``(conv_dim, key_heads, key_dim, value_heads, value_dim)`` a region holds (key heads from its shapes:
    ``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim``; 0 when they do not add up)."""
    conv_dim, (hv, dk, dv) = r.conv_shape[2], r.recurrent_shape[2:]
    qk = conv_dim - hv * dv
    hk = qk // (2 * dk) if dk > 0 and qk > 0 and qk % (2 * dk) == 0 else 0
    return conv_dim, hk, dk, hv, dv


def check_state_region(peer: StateEngineRegion | None, local: StateEngineRegion, slot: int, key_heads: int,
                       value_heads: int) -> str | None:
    """Why the state in ``local``'s buffers cannot be written into slot ``slot`` of ``peer`` (None: it can): a
    region without a state pool or a slot, other dtypes, layer counts or per-head sizes, a slot out of the peer's
    pool (or its scratch slot), or heads that are not some of the model's ``key_heads`` / ``value_heads``."""
    if peer is None or slot < 0:
        return "decode registered no linear-attention state slot for this hybrid model's request"
    if (peer.conv_dtype, peer.recurrent_dtype) != (local.conv_dtype, local.recurrent_dtype) \
            or peer.conv_dtype not in FLOAT_DTYPE_NAMES or peer.recurrent_dtype not in FLOAT_DTYPE_NAMES:
        return f"decode state pool dtypes {peer.conv_dtype}/{peer.recurrent_dtype} != prefill's " \
               f"{local.conv_dtype}/{local.recurrent_dtype}"
    if len(peer.conv_shape) != 4 or len(peer.recurrent_shape) != 5 or peer.conv_shape[0] != local.conv_shape[0] \
            or peer.conv_shape[3] != local.conv_shape[3] or peer.recurrent_shape[3:] != local.recurrent_shape[3:] \
            or peer.recurrent_shape[:2] != peer.conv_shape[:2]:
        return f"decode state pool shapes {peer.conv_shape}, {peer.recurrent_shape} do not match prefill's " \
               f"{local.conv_shape}, {local.recurrent_shape} but for slots and heads"
    if not 0 <= slot < peer.conv_shape[1] - 1:  # the last slot is the peer's scratch slot
        return f"decode state slot {slot} is out of its pool's {peer.conv_shape[1] - 1} slots"
    _, hk, _, hv, _ = _sizes(peer)
    if hk <= 0 or hv <= 0 or not 0 <= peer.key_start <= key_heads - hk or not 0 <= peer.value_start <= value_heads - hv:
        return f"decode state pool holds DeltaNet key heads {peer.key_start}..+{hk} and value heads " \
               f"{peer.value_start}..+{hv}, not of the model's {key_heads} and {value_heads}"
    return None


def state_copies(local: StateEngineRegion, src_slot: int, peer: StateEngineRegion, dst_slot: int) -> Copies:
    """The writes ``(source address, peer address, bytes)`` that move slot ``src_slot`` of ``local``'s state
    buffers into slot ``dst_slot`` of ``peer``'s (checked by :func:`check_state_region`), every layer, of the
    DeltaNet heads both hold; none when they share none. Runs adjacent on both sides are merged."""
    out: Copies = []
    conv_es = torch.empty((), dtype=getattr(torch, local.conv_dtype)).element_size()
    rec_es = torch.empty((), dtype=getattr(torch, local.recurrent_dtype)).element_size()
    (sc, shk, dk, shv, dv), (dc, dhk, _, dhv, _) = _sizes(local), _sizes(peer)
    kernel, layers = local.conv_shape[3], local.conv_shape[0]
    # (first head, heads, channels per head, this part's first channel) on each side, per conv part q | k | v
    parts = [((local.key_start, shk, dk, 0), (peer.key_start, dhk, dk, 0)),
             ((local.key_start, shk, dk, shk * dk), (peer.key_start, dhk, dk, dhk * dk)),
             ((local.value_start, shv, dv, 2 * shk * dk), (peer.value_start, dhv, dv, 2 * dhk * dk))]
    for layer in range(layers):
        src_row = (layer * local.conv_shape[1] + src_slot) * sc  # the slot's first channel in the buffer
        dst_row = (layer * peer.conv_shape[1] + dst_slot) * dc
        for (s0, sn, width, s_off), (d0, dn, _, d_off) in parts:
            lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
            if lo < hi:
                _append(out, local.conv_base + (src_row + s_off + (lo - s0) * width) * kernel * conv_es,
                        peer.conv_base + (dst_row + d_off + (lo - d0) * width) * kernel * conv_es,
                        (hi - lo) * width * kernel * conv_es)
        lo, hi = max(local.value_start, peer.value_start), min(local.value_start + shv, peer.value_start + dhv)
        if lo < hi:
            head = dk * dv * rec_es
            src = (layer * local.recurrent_shape[1] + src_slot) * shv + lo - local.value_start
            dst = (layer * peer.recurrent_shape[1] + dst_slot) * dhv + lo - peer.value_start
            _append(out, local.recurrent_base + src * head, peer.recurrent_base + dst * head, (hi - lo) * head)
    return out


def _append(out: Copies, src: int, dst: int, nbytes: int) -> None:
    """Add a write to ``out``, merged into the last one when it continues it on both sides."""
    if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
        out[-1] = (out[-1][0], out[-1][1], out[-1][2] + nbytes)
    else:
        out.append((src, dst, nbytes))
