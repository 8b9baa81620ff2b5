"""One request's linear-attention state (a hybrid model's :class:`~epdserve.kvcache.state_pool.StatePool` slot) read
out whole and written back, across TP ranks: the state half of the prefill -> decode hand-off, beside
:meth:`~epdserve.engine.model_runner.ModelRunner.read_kv` / ``write_kv`` for the attention layers' KV.

Whole means every DeltaNet head in the checkpoint's channel order, whatever the TP size of either side:

- conv ``[layers, conv_dim, kernel]`` in the pool's dtype, channels q | k | v as ``in_proj_qkv`` makes them;
- recurrent ``[layers, value_heads, key_dim, value_dim]`` in the pool's recurrent dtype (float32).

A TP rank holds its own heads only (:func:`~epdserve.models.qwen3_5_deltanet.deltanet_parts`): reading all-gathers the
ranks' slices and puts the conv channels back in q | k | v order; writing broadcasts rank 0's whole state and
each rank keeps its slices, so any prefill TP size can feed any decode TP size, as for the KV.
"""

from __future__ import annotations

import torch

from epdserve.engine.distributed import TPGroup
from epdserve.kvcache.state_pool import StatePool
from epdserve.models.config import ModelConfig
from epdserve.models.qwen3_5_deltanet import deltanet_heads, deltanet_parts


def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The whole-state shapes of one request: conv ``(layers, conv_dim, kernel)`` and recurrent ``(layers,
    value_heads, key_dim, value_dim)`` (see the module docstring)."""
    layers = len(cfg.linear_layers)
    return ((layers, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim),
            (layers, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def read_state(pool: StatePool, slot: int, cfg: ModelConfig, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``slot``'s whole state as contiguous CPU tensors ``(conv, recurrent)`` (module docstring for shapes).
    With TP every rank calls it (an all-gather) and every rank gets the whole state."""
    with torch.no_grad():
        conv, rec = pool.conv_buffer[:, slot], pool.recurrent_buffer[:, slot]
        if tp.size > 1:
            n, parts = tp.size, [length for _, _, length in deltanet_parts(cfg, tp)]
            pieces = tp.all_gather(conv, dim=1).split(parts * n, dim=1)  # rank-major: q_r | k_r | v_r per rank
            conv = torch.cat([pieces[r * len(parts) + p] for p in range(len(parts)) for r in range(n)], dim=1)
            rec = tp.all_gather(rec, dim=1)
        return conv.to("cpu").contiguous(), rec.to("cpu").contiguous()


def write_state(pool: StatePool, slot: int, conv: torch.Tensor, recurrent: torch.Tensor, cfg: ModelConfig,
                tp: TPGroup) -> None:
    """Store a whole state ``(conv, recurrent)`` into slot ``slot`` (cast to the pool's dtypes). With TP every
    rank calls it: rank 0's tensors are broadcast (the others pass any tensors of the whole shapes, the pool's
    dtypes, on the pool's device) and each rank keeps its heads.

    Raises:
        ValueError: the tensors do not have the whole-state shapes of ``cfg``.
    """
    want = state_shapes(cfg)
    if (tuple(conv.shape), tuple(recurrent.shape)) != want:
        raise ValueError(f"state shapes {tuple(conv.shape)}, {tuple(recurrent.shape)} != expected {want[0]}, "
                         f"{want[1]}")
    with torch.no_grad():
        if tp.size > 1:
            conv = tp.broadcast(conv.to(pool.device, pool.dtype).contiguous())
            recurrent = tp.broadcast(recurrent.to(pool.device, pool.recurrent_dtype).contiguous())
            rows, offset = [], 0
            for full, start, length in deltanet_parts(cfg, tp):
                rows.append(conv[:, offset + start:offset + start + length])
                offset += full
            conv = torch.cat(rows, dim=1)
            _, _, v0, hv = deltanet_heads(cfg, tp)
            recurrent = recurrent[:, v0:v0 + hv]
        pool.conv_buffer[:, slot] = conv.to(pool.device)
        pool.recurrent_buffer[:, slot] = recurrent.to(pool.device)


def copy_slot(pool: StatePool, src_slot: int, dst_slot: int) -> None:
    """Copy this pool's slot ``src_slot`` into ``dst_slot`` (this rank's heads; every TP rank calls it), queued on
    the current stream: a prefix-cache snapshot taken or restored (:mod:`epdserve.kvcache.state_snapshots`)."""
    with torch.no_grad():
        pool.conv_buffer[:, dst_slot].copy_(pool.conv_buffer[:, src_slot])
        pool.recurrent_buffer[:, dst_slot].copy_(pool.recurrent_buffer[:, src_slot])


def copy_state(pool: StatePool, peer_conv: torch.Tensor, peer_recurrent: torch.Tensor, src_slot: int,
               dst_slot: int) -> None:
    """Copy slot ``src_slot`` of a mapped peer pool's buffers (``[layers, peer_slots, *shape]``, one TP rank's
    whole heads: shared hand-offs are between single-rank servers) into this pool's ``dst_slot``, queued on the
    current stream.

    Raises:
        ValueError: the peer's per-slot shapes or dtypes differ from this pool's, or ``src_slot`` is out of range.
    """
    mine = (pool.conv_buffer, pool.recurrent_buffer)
    for peer, own in zip((peer_conv, peer_recurrent), mine):
        if peer.dim() != own.dim() or peer.shape[0] != own.shape[0] or peer.shape[2:] != own.shape[2:] \
                or peer.dtype != own.dtype:
            raise ValueError(f"prefill state pool {tuple(peer.shape)} {peer.dtype} does not match this pool's "
                             f"{tuple(own.shape)} {own.dtype} (slots aside)")
        if not 0 <= src_slot < peer.shape[1]:
            raise ValueError(f"state slot {src_slot} out of the prefill pool's {peer.shape[1]} slots")
    with torch.no_grad():
        pool.conv_buffer[:, dst_slot].copy_(peer_conv[:, src_slot], non_blocking=True)
        pool.recurrent_buffer[:, dst_slot].copy_(peer_recurrent[:, src_slot], non_blocking=True)
