"""The sparse mixture-of-experts block of Qwen3-VL-MoE (``qwen3_vl_moe``, e.g. Qwen3-VL-30B-A3B): router and
routed experts (computed by :mod:`epdserve.models.moe_experts`: exact against transformers in float32 on the CPU,
graph-capturable on CUDA).

Reference: transformers 5 ``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py`` (``Qwen3VLMoeTextTopKRouter``,
``Qwen3VLMoeTextExperts``, ``Qwen3VLMoeTextSparseMoeBlock``, ``Qwen3VLMoeTextDecoderLayer``) and
``conversion_mapping.py`` (``"qwen3_vl_moe"``). Facts taken from there:

- Router: ``logits = x W_g^T`` (``W_g`` ``[E, hidden]``, no bias), softmax over all ``E`` experts in float32,
  ``topk(k)`` of the probabilities, then the ``k`` weights are always renormalised to sum to 1 (the model has
  no ``norm_topk_prob`` switch: its config has no such key), and cast back to the logits' dtype.
- Experts: SiLU-gated MLPs without bias; no shared experts. transformers holds them fused in memory as
  ``gate_up_proj`` ``[E, 2I, hidden]`` (gate rows first, then up) and ``down_proj`` ``[E, hidden, I]``, and
  ``save_pretrained`` writes them so; the released hub checkpoint stores the transposes (``[E, hidden, 2I]`` and
  ``[E, I, hidden]``), which transformers' loader transposes (``Transpose(1, 2, check_dims=True)``: only when the
  shape is not already the in-memory one). :meth:`Experts.load_shard` takes both the same way.
- Which layers are sparse: layer ``i`` is when ``i not in mlp_only_layers`` and ``num_experts > 0`` and
  ``(i + 1) % decoder_sparse_step == 0``; the others keep the dense MLP of ``intermediate_size``.

Tensor parallelism shards every expert's intermediate size ``I`` as the dense MLP's is sharded (rank ``r`` holds
``[r * I/size, (r+1) * I/size)`` of gate, of up, and of down's input features); the router is replicated, so every
rank picks the same experts, and one all-reduce sums the partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from epdserve.engine.distributed import TPGroup
from epdserve.attention.base import AttentionBackend
from epdserve.models.config import ModelConfig
from epdserve.models import decode_gemv
from epdserve.models.moe_decode import route_fused, route_logits
from epdserve.models.moe_experts import run_experts
from epdserve.models.parallel import split_evenly
from epdserve.models.qwen3_vl_lm import Qwen3VLLanguageModel


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of Qwen3-VL-MoE: ``x`` ``[T, hidden]`` and ``gate_weight`` ``[E, hidden]`` (same dtype) ->
    ``(weights, experts)``, ``[T, top_k]`` each: the renormalised softmax probabilities in ``x``'s dtype and the
    int64 expert ids, in descending probability.

    On CUDA the softmax, top-k and renormalisation run as one kernel
    (:func:`~epdserve.models.moe_decode.route_fused`: five launches fewer per layer, a decode step at one row 0.89x
    on an H200), which may order two near-equal probabilities the other way, or pick the other expert of a tie at
    the k-th place; elsewhere :func:`route_torch`, transformers' arithmetic."""
    if x.is_cuda:
        return route_fused(x, gate_weight, top_k)
    return route_torch(x, gate_weight, top_k)


def route_torch(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` in torch's ops, the order of transformers' ``Qwen3VLMoeTextTopKRouter`` (the reference)."""
    logits = F.linear(x, gate_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class Experts(nn.Module):
    """``E`` routed SiLU-gated experts held fused: ``gate_up_proj`` ``[E, 2 * I_r, hidden]`` (this rank's gate rows,
    then its up rows) and ``down_proj`` ``[E, hidden, I_r]``, ``I_r = I / tp.size`` (transformers' in-memory
    layout, sharded).

    Raises:
        ValueError: ``intermediate`` cannot be split over ``tp.size`` ranks.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int, tp: TPGroup):
        super().__init__()
        self.inter = intermediate
        self.method: str | None = None  # see forward
        self.start, self.local = split_evenly(intermediate, tp, "moe intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.local))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]``, routing ``weights`` (x's dtype) and ``experts`` (int64) ``[T, top_k]`` -> this
        rank's partial sum ``[T, hidden]`` of ``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``, computed by
        :func:`~epdserve.models.moe_experts.run_experts` with ``self.method`` (None: its default for the device:
        the exact loop on the CPU, a graph-capturable path on CUDA)."""
        return run_experts(x, self.gate_up_proj, self.down_proj, weights, experts, self.method)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None = None) -> None:
        """Copy a checkpoint tensor into ``param``, keeping this rank's slice of the intermediate features.

        ``gate_up_proj`` comes as ``[E, 2I, hidden]`` (transformers 5's ``save_pretrained``) or ``[E, hidden, 2I]``
        (the released checkpoint), ``down_proj`` as ``[E, hidden, I]`` or ``[E, I, hidden]``; as in transformers'
        loader, a tensor already of the in-memory shape is taken as is (so a square one is never transposed).
        ``part`` is unused (the checkpoint has the fused tensors).

        Raises:
            ValueError: a shape that is neither layout.
        """
        e, h = self.down_proj.shape[:2]
        up = param is self.gate_up_proj
        full = (e, 2 * self.inter, h) if up else (e, h, self.inter)
        if tuple(tensor.shape) != full:
            if tuple(tensor.shape) != (e, full[2], full[1]):
                raise ValueError(f"checkpoint shape {tuple(tensor.shape)} is neither {full} nor its transpose")
            tensor = tensor.transpose(1, 2)
        s, n, i = self.start, self.local, self.inter
        if up:  # this rank's gate rows, then its up rows
            tensor = torch.cat([tensor[:, s:s + n], tensor[:, i + s:i + s + n]], dim=1)
        else:
            tensor = tensor[..., s:s + n]
        param.data.copy_(tensor)


class SparseMoeBlock(nn.Module):
    """Router (``gate.weight`` ``[E, hidden]``, replicated) plus :class:`Experts`: ``[T, hidden]`` ->
    ``[T, hidden]``, all-reduced over the TP group. No host sync on CUDA (routing is ``topk`` on the device, the
    experts run :mod:`epdserve.models.moe_experts`' capturable path), so decode CUDA graphs capture it.

    Raises:
        ValueError: ``moe_intermediate_size`` cannot be split over ``tp.size`` ranks.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.tp, self.top_k = tp, top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        return self._experts(x, *route(x, self.gate.weight, self.top_k))

    # forward_with_norm's x may be split-K parts [S, T, hidden] (the attention's o_proj at one row past
    # decode_gemv.MAX_K, e.g. the 30B-A3B's 4096 query features): the router's GEMV sums them
    takes_parts = True

    def forward_with_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode row's ``(forward(norm(x + residual)), x + residual)`` on CUDA with the add + RMSNorm inside the
        router's GEMV, which also hands the normed row to the experts
        (:func:`~epdserve.models.decode_gemv.norm_gemv_normed`): the norm's kernel and the router's cuBLAS GEMM
        become one launch whose weights load before the kernel ahead of it ends. ``x``: ``[T, hidden]`` or float32
        split-K parts ``[S, T, hidden]``, which that GEMV sums."""
        logits, residual, normed = decode_gemv.norm_gemv_normed(x, self.gate.weight, norm.weight, norm.eps, residual)
        return self._experts(normed, *route_logits(logits, self.top_k)), residual

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, weights, experts)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def is_sparse_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Whether decoder layer ``layer_id`` has routed experts (transformers' ``Qwen3VLMoeTextDecoderLayer`` rule)."""
    return (layer_id not in cfg.mlp_only_layers and cfg.num_experts > 0
            and (layer_id + 1) % cfg.decoder_sparse_step == 0)


class Qwen3VLMoeLanguageModel(Qwen3VLLanguageModel):
    """The Qwen3-VL-MoE text decoder: :class:`~epdserve.models.qwen3_vl_lm.Qwen3VLLanguageModel` (attention, q/k
    norms, interleaved M-RoPE, DeepStack, paged KV, same interface) whose sparse layers (:func:`is_sparse_layer`)
    carry a :class:`SparseMoeBlock` as ``mlp``; the other layers keep the dense MLP of ``intermediate_size``.

    ``load_weights`` takes Qwen3-VL's names plus ``layers.N.mlp.gate.weight`` ``[E, hidden]`` and the fused
    ``layers.N.mlp.experts.gate_up_proj`` / ``down_proj`` in either layout of :meth:`Experts.load_shard`.

    Raises:
        ValueError: heads, KV heads, the intermediate or the experts' intermediate size cannot be split over
            ``tp.size`` ranks.
    """

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend | None = None, tp: TPGroup | None = None):
        super().__init__(cfg, attn, tp)
        tp = tp or TPGroup.single()
        for i, layer in enumerate(self.layers):
            if is_sparse_layer(cfg, i):
                layer.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                           cfg.moe_intermediate_size, tp)
