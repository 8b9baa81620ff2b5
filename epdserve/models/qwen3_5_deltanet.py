"""Qwen3.5's Gated DeltaNet layer (linear attention; Yang et al., arXiv:2412.06464) over the
:class:`~epdserve.kvcache.state_pool.StatePool`, and how its heads split over TP ranks. The layer's two
implementations (transformers' torch references on the CPU, flash-linear-attention's kernels on CUDA) are described
in :mod:`epdserve.models.qwen3_5_lm`; the CUDA kernels live in :mod:`epdserve.models.deltanet_cuda`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.engine.distributed import TPGroup
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.state_pool import StatePool
from epdserve.models.config import ModelConfig
from epdserve.models.parallel import RowParallelLinear, split_evenly

log = logging.getLogger(__name__)

_KERNELS = ("causal_conv1d_update", "causal_conv1d_fn", "torch_recurrent_gated_delta_rule",
            "torch_chunk_gated_delta_rule")


@functools.lru_cache(maxsize=None)
def _kernels(device_type: str) -> SimpleNamespace:
    """:func:`_ref`'s kernels for a device type (looked up once)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    fns = {name: getattr(modeling_qwen3_5, name) for name in _KERNELS}
    if device_type != "cuda":
        fns = {name: inspect.unwrap(fn) for name, fn in fns.items()}
    return SimpleNamespace(**fns)


def _ref(device: torch.device) -> SimpleNamespace:
    """The DeltaNet kernels for tensors on ``device``, from transformers' Qwen3.5 module (imported on first use,
    like flashinfer elsewhere): its functions are wrapped to run flash-linear-attention's (``fla-core``) and the
    ``causal-conv1d`` package's CUDA kernels when those import, else its torch code. On the CPU the wrappers are
    peeled off (``inspect.unwrap``): always the torch references, so CPU output equals transformers' torch path
    even where those packages are installed (their kernels are GPU-only)."""
    return _kernels(device.type)


@functools.lru_cache(maxsize=None)
def _deltanet_kernels_available() -> bool:
    """Whether flash-linear-attention imports (checked once per process; logs the install hint when not)."""
    from epdserve.models import deltanet_cuda

    try:
        deltanet_cuda._fla()
    except ImportError as e:
        log.warning("%s; DeltaNet layers run transformers' slower torch code", e)
        return False
    return True


def deltanet_heads(cfg: ModelConfig, tp: TPGroup) -> tuple[int, int, int, int]:
    """``(key_start, key_heads, value_start, value_heads)`` of TP rank ``tp.rank``'s DeltaNet heads.

    Raises:
        ValueError: the key or value heads do not split evenly over ``tp.size`` ranks.
    """
    k0, hk = split_evenly(cfg.linear_num_key_heads, tp, "linear-attention key heads")
    v0, hv = split_evenly(cfg.linear_num_value_heads, tp, "linear-attention value heads")
    return k0, hk, v0, hv


def deltanet_parts(cfg: ModelConfig, tp: TPGroup) -> list[tuple[int, int, int]]:
    """This rank's ``(full, start, length)`` slices of the fused q|k|v channels of ``in_proj_qkv`` and the conv
    (the :class:`~epdserve.models.parallel.ColumnParallelLinear` part format): its key heads of q and k, its value
    heads of v."""
    k0, hk, v0, hv = deltanet_heads(cfg, tp)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qk = (cfg.linear_num_key_heads * dk, k0 * dk, hk * dk)
    return [qk, qk, (cfg.linear_num_value_heads * dv, v0 * dv, hv * dv)]


def deltanet_local_shapes(cfg: ModelConfig, tp: TPGroup) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One request's per-layer state shapes on TP rank ``tp.rank``: conv ``(local_conv_dim, kernel)`` and
    recurrent ``(local_value_heads, key_dim, value_dim)``."""
    _, _, _, hv = deltanet_heads(cfg, tp)
    conv = sum(length for _, _, length in deltanet_parts(cfg, tp))
    return (conv, cfg.linear_conv_kernel_dim), (hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def _take_parts(tensor: torch.Tensor, parts: list[tuple[int, int, int]]) -> torch.Tensor:
    """Rows ``[start, start + length)`` of each consecutive ``full``-row block of ``tensor``, concatenated."""
    rows, offset = [], 0
    for full, start, length in parts:
        rows.append(tensor[offset + start:offset + start + length])
        offset += full
    if offset != tensor.shape[0]:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} has {tensor.shape[0]} rows, expected {offset}")
    return torch.cat(rows)


class DeltaNetInProj(nn.Module):
    """``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` as one bias-free projection (one GEMM a layer instead of
    four; ``b`` and ``a`` have only ``value_heads`` rows each), ``[T, hidden]`` -> ``[T, sum(sizes)]``. Checkpoint
    tensor ``i`` of the four is part ``i``; this rank keeps its heads' rows of each (``in_proj_qkv``: its q, k and
    v heads, :func:`deltanet_parts`)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        _, _, v0, hv = deltanet_heads(cfg, tp)
        hv_all, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.parts = [deltanet_parts(cfg, tp), [(hv_all * dv, v0 * dv, hv * dv)], [(hv_all, v0, hv)],
                      [(hv_all, v0, hv)]]
        self.sizes = [sum(length for _, _, length in parts) for parts in self.parts]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        """Keep this rank's rows of checkpoint tensor ``part`` (0 qkv, 1 z, 2 b, 3 a). Raises ValueError on a
        shape mismatch."""
        rows = _take_parts(tensor, self.parts[part or 0])
        offset, size = sum(self.sizes[:part or 0]), self.sizes[part or 0]
        if rows.shape != (size, param.shape[1]):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not give {(size, param.shape[1])}")
        param.data[offset:offset + size].copy_(rows)


class PartsConv1d(nn.Module):
    """The depthwise causal conv's weight ``[channels, 1, kernel]`` (only the weight: the kernels take it), whose
    channels are this rank's ``parts`` slices (:func:`deltanet_parts`) of the checkpoint's."""

    def __init__(self, parts: list[tuple[int, int, int]], kernel: int):
        super().__init__()
        self.parts = parts
        self.weight = nn.Parameter(torch.empty(sum(p[2] for p in parts), 1, kernel))

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        """Keep this rank's channels of the whole checkpoint ``tensor``. Raises ValueError on a shape mismatch."""
        rows = _take_parts(tensor, self.parts)
        if rows.shape != param.shape:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not give {tuple(param.shape)}")
        param.data.copy_(rows)


class GatedRMSNorm(nn.Module):
    """``Qwen3_5RMSNormGated``: ``w * norm(x).to(x.dtype) * silu(z.float())``, cast to ``x.dtype``; ``x``, ``z``
    ``[N, dim]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


@dataclass
class DeltaNetBatch:
    """What every DeltaNet layer of one forward shares: the requests' state slots (int64 ``[B]``, device) and,
    for an extend on the CUDA kernels, the packed tokens' offsets (int64 ``[B + 1]``, on the device and the host),
    or, for one request's extend in a prefill CUDA graph, its last real row (int64 ``[1]``, device; the rows
    after it are padding); for an extend on the kernels that takes state snapshots, where they are cut
    (:class:`~epdserve.models.deltanet_cuda.SnapshotCuts`)."""

    slots: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    last_row: torch.Tensor | None = None
    cuts: object | None = None  # deltanet_cuda.SnapshotCuts: the kernels' form of ForwardBatch.state_snapshots


class GatedDeltaNet(nn.Module):
    """``Qwen3_5GatedDeltaNet`` over a :class:`StatePool` (parameter names as in the checkpoint, but for the four
    input projections, fused in ``in_proj``). ``state_layer``: this layer's index among the pool's layers.

    Two implementations, chosen per model (``fused``): the torch references of transformers (CPU, the parity
    path), or flash-linear-attention's kernels over the slots in place (:mod:`epdserve.models.deltanet_cuda`)."""

    def __init__(self, cfg: ModelConfig, state_layer: int, tp: TPGroup):
        super().__init__()
        self.state_layer = state_layer
        _, self.hk, self.v0, self.hv = deltanet_heads(cfg, tp)
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        hv_all, dv = cfg.linear_num_value_heads, self.dv
        self.conv1d = PartsConv1d(deltanet_parts(cfg, tp), self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(hv_all * dv, cfg.hidden_size, tp)
        self.in_proj = DeltaNetInProj(cfg, tp)
        self.fused = False
        self.kernel_params: dict[str, torch.Tensor] = {}

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        """``A_log`` / ``dt_bias`` (``[value_heads]`` in the checkpoint): keep this rank's value heads. Raises
        ValueError on a shape mismatch."""
        if tensor.shape != (param.shape[0] * self.out_proj.tp.size,):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != ({param.shape[0] * self.out_proj.tp.size},)")
        param.data.copy_(tensor[self.v0:self.v0 + self.hv])

    def use_kernels(self, enabled: bool) -> None:
        """Switch to the CUDA kernels (after the weights are loaded: they take derived copies of some)."""
        self.fused = enabled
        self.kernel_params = {} if not enabled else {
            "conv_weight": self.conv1d.weight.squeeze(1).contiguous(),  # [conv_dim, kernel]
            "dt_bias_k": self.dt_bias.repeat_interleave(self.dk).contiguous(),  # a bias per key feature
            "norm_weight": self.norm.weight.repeat(self.hv).contiguous()}  # one norm weight per head

    def forward(self, x: torch.Tensor, batch: ForwardBatch, dn: DeltaNetBatch, pool: StatePool) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; reads and writes the states of ``dn.slots``."""
        mixed, z, b, a = self.in_proj(x).split(self.in_proj.sizes, dim=-1)
        if self.fused:
            return self.out_proj(self._forward_kernels(mixed, z, b, a, batch, dn, pool))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if batch.is_decode:
            core = self._step(mixed, g, beta, dn.slots, pool)
        else:
            cuts = {i: (cut, dst) for i, cut, dst in batch.state_snapshots or ()}
            core, start = [], 0
            for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
                end, slot, continued = start + q_len, dn.slots[i:i + 1], kv_len > q_len
                if i in cuts:  # the state after the first ``cut`` new tokens goes to a snapshot slot on the way
                    cut, dst = cuts[i]
                    core.append(self._extend(mixed[start:start + cut], g[start:start + cut],
                                             beta[start:start + cut], slot, pool, continued))
                    layer = self.state_layer
                    pool.conv[layer][dst] = pool.conv[layer][slot[0]]
                    pool.recurrent[layer][dst] = pool.recurrent[layer][slot[0]]
                    start, continued = start + cut, True
                core.append(self._extend(mixed[start:end], g[start:end], beta[start:end], slot, pool, continued))
                start = end
            core = torch.cat(core)
        z = z.reshape(-1, self.dv)
        return self.out_proj(self.norm(core.reshape(-1, self.dv), z).reshape(x.shape[0], -1))

    def _forward_kernels(self, mixed, z, b, a, batch: ForwardBatch, dn: DeltaNetBatch, pool: StatePool):
        """The CUDA kernels' path (:mod:`epdserve.models.deltanet_cuda`): ``[T, hv * dv]`` before ``out_proj``."""
        from epdserve.models import deltanet_cuda

        kp, layer, heads = self.kernel_params, self.state_layer, (self.hk, self.hv, self.dk, self.dv)
        if batch.is_decode:
            core = deltanet_cuda.decode(mixed, a, b, dn.slots, pool.conv[layer], pool.recurrent[layer],
                                        kp["conv_weight"], self.A_log, kp["dt_bias_k"], heads)
        else:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
            if dn.last_row is not None:  # one request padded in a prefill CUDA graph
                core = deltanet_cuda.extend_padded(mixed, g, b.sigmoid(), dn.slots, dn.last_row, pool.conv[layer],
                                                   pool.recurrent[layer], kp["conv_weight"], heads)
            else:
                core = deltanet_cuda.extend(mixed, g, b.sigmoid(), dn.slots, dn.cu_seqlens, dn.cu_seqlens_cpu,
                                            pool.conv[layer], pool.recurrent[layer], kp["conv_weight"], heads,
                                            cuts=dn.cuts)
        return deltanet_cuda.gated_norm(core, z, kp["norm_weight"], self.norm.eps)

    def _qkv(self, conv_out: torch.Tensor, n: int, t: int):
        """Conv output ``[n, t, conv_dim]`` -> q, k, v ``[n, t, hv, d]``: q and k repeated to the value heads (each
        key head serves ``hv / hk`` consecutive value heads, ``Qwen3_5GatedDeltaNet``'s ``repeat_interleave``).

        transformers' torch delta-rule references differ by release: 5.17's expect the heads already repeated (its
        module repeats them first) and fail on grouped heads; 5.24's repeat inside when the counts differ, a no-op
        on repeated heads. Repeating here is right for both."""
        q, k, v = conv_out.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k = q.reshape(n, t, self.hk, self.dk), k.reshape(n, t, self.hk, self.dk)
        if self.hv != self.hk:
            q, k = (x.repeat_interleave(self.hv // self.hk, dim=2) for x in (q, k))
        return q, k, v.reshape(n, t, self.hv, self.dv)

    def _step(self, mixed, g, beta, slots, pool) -> torch.Tensor:
        """One token for each of B requests: ``causal_conv1d_update`` and ``torch_recurrent_gated_delta_rule``
        (the path transformers takes for a cached one-token step), batched over the requests' slots."""
        ref, layer = _ref(mixed.device), self.state_layer
        conv_state = pool.conv[layer][slots]  # a gathered copy, updated in place, scattered back
        out = ref.causal_conv1d_update(mixed[:, :, None], conv_state, self.conv1d.weight.squeeze(1), None, "silu")
        pool.conv[layer][slots] = conv_state
        q, k, v = self._qkv(out.transpose(1, 2), mixed.shape[0], 1)
        core, state = ref.torch_recurrent_gated_delta_rule(
            q, k, v, g=g[:, None], beta=beta[:, None], initial_state=pool.recurrent[layer][slots],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        pool.recurrent[layer][slots] = state.to(pool.recurrent_dtype)
        return core

    def _extend(self, mixed, g, beta, slot, pool, continued: bool) -> torch.Tensor:
        """One request's ``q_len`` new tokens after its slot's state: the conv runs over ``[state | new]``
        (``update_conv_state`` then ``causal_conv1d_fn``; a fresh slot's zeros equal the conv's zero padding);
        the delta rule is ``torch_chunk_gated_delta_rule`` from the slot's state, or, for one token continuing a
        state, ``torch_recurrent_gated_delta_rule`` (transformers' choice for ``seq_len == 1`` with a cache)."""
        ref, layer, t = _ref(mixed.device), self.state_layer, mixed.shape[0]
        if not continued:  # a fresh request: transformers' empty cache (the slot may hold a previous request's)
            pool.conv[layer][slot] = 0
            pool.recurrent[layer][slot] = 0
        full = torch.cat([pool.conv[layer][slot], mixed.T[None].to(pool.dtype)], dim=-1)  # [1, C, K + t]
        pool.conv[layer][slot] = full[..., -self.kernel:]
        out = ref.causal_conv1d_fn(full, self.conv1d.weight.squeeze(1), None, activation="silu")[..., -t:]
        q, k, v = self._qkv(out.transpose(1, 2).to(mixed.dtype), 1, t)
        rule = ref.torch_recurrent_gated_delta_rule if continued and t == 1 else ref.torch_chunk_gated_delta_rule
        core, state = rule(q, k, v, g=g[None], beta=beta[None], initial_state=pool.recurrent[layer][slot],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        pool.recurrent[layer][slot] = state.to(pool.recurrent_dtype)
        return core[0]
