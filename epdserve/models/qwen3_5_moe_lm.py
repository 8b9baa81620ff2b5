"""Qwen3.5-MoE's language model (``qwen3_5_moe``, e.g. Qwen3.5-35B-A3B): the hybrid Qwen3.5 decoder of
:mod:`epdserve.models.qwen3_5_lm` (Gated DeltaNet and gated attention, state pool, paged KV) whose every MLP is a
sparse block of routed experts plus a gated shared expert.

Reference: transformers 5 ``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (``Qwen3_5MoeSparseMoeBlock``,
``Qwen3_5MoeTopKRouter``, ``Qwen3_5MoeExperts``, ``Qwen3_5MoeDecoderLayer``) and ``conversion_mapping.py``
(``qwen3_5_moe_text``: Qwen3.5's names plus ``qwen2_moe``'s expert merge). Facts taken from there:

- Every decoder layer's MLP is sparse (the config has no ``decoder_sparse_step``, ``mlp_only_layers`` or dense
  ``intermediate_size``).
- Block: ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``. The router is Qwen3-VL-MoE's
  (``Qwen3_5MoeTopKRouter`` subclasses ``Qwen3VLMoeTextTopKRouter``: float32 softmax over all experts, top-k,
  renormalised; :func:`~epdserve.models.qwen3_vl_moe_lm.route`), the experts Qwen3-VL-MoE's fused SiLU-gated ones
  (:class:`~epdserve.models.qwen3_vl_moe_lm.Experts`); ``shared_expert`` a dense SiLU-gated MLP of
  ``shared_expert_intermediate_size``, ``shared_expert_gate`` a ``[1, hidden]`` linear without bias.
- Checkpoints: the released ones hold fused ``mlp.experts.gate_up_proj`` ``[E, 2I, hidden]`` and ``down_proj``
  ``[E, hidden, I]``; transformers' ``save_pretrained`` writes one tensor per expert
  (``mlp.experts.{e}.gate_proj.weight`` ``[I, hidden]``, ``up_proj``, ``down_proj`` ``[hidden, I]``), which
  :func:`fuse_per_expert` stacks back, one layer at a time.

Tensor parallelism: the routed experts as Qwen3-VL-MoE's (each expert's intermediate features split, router
replicated), the shared expert as the dense MLP (column- then row-parallel), ``shared_expert_gate`` replicated.
Each rank adds its partial routed sum and its gated partial shared-expert output (the gate scales partial sums as it
would the whole), and one all-reduce per block sums them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from epdserve.engine.distributed import TPGroup
from epdserve.models.config import ModelConfig
from epdserve.models.qwen2_vl_lm import MLP
from epdserve.models.qwen3_5_lm import Qwen3_5LanguageModel
from epdserve.models.qwen3_vl_moe_lm import Experts, route


class SharedExpertMoeBlock(nn.Module):
    """``Qwen3_5MoeSparseMoeBlock``: ``[T, hidden]`` -> ``[T, hidden]`` (same dtype), the routed experts' weighted
    sum (router ``gate.weight`` ``[E, hidden]``, :class:`~epdserve.models.qwen3_vl_moe_lm.Experts`) plus the shared
    expert (:class:`~epdserve.models.qwen2_vl_lm.MLP`) scaled by ``sigmoid(shared_expert_gate(x))`` ``[T, 1]``.

    Raises:
        ValueError: the experts' or the shared expert's intermediate size cannot be split over ``tp.size`` ranks.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp, self.top_k = tp, cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp)
        self.shared_expert = MLP(cfg, tp, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; the sum in transformers' order (routed + gated shared). Under TP both
        parts are this rank's partial sums (the gate is replicated, so it scales a partial as it would the whole)
        and one all-reduce sums them."""
        routed = self.experts(x, *route(x, self.gate.weight, self.top_k))
        out = routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return self.tp.all_reduce(out)


# One expert's projection in transformers' per-expert checkpoint names (after any prefix: lm names, or the
# checkpoint's ``model.language_model.`` ones).
_PER_EXPERT = re.compile(r"(.*layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_per_expert(weights: Iterable[tuple[str, torch.Tensor]],
                    num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with per-expert tensors (``[prefix]layers.N.mlp.experts.{e}.gate_proj.weight`` ``[I, hidden]``,
    ``up_proj`` alike, ``down_proj`` ``[hidden, I]``) replaced by the fused ones :class:`Experts` loads:
    ``layers.N.mlp.experts.gate_up_proj`` ``[E, 2I, hidden]`` (gate rows, then up rows) and ``down_proj``
    ``[E, hidden, I]`` (same prefix), each yielded once all its experts arrived; every other tensor passes through
    unchanged.
    Holds at most the fused tensors of the layers whose experts are still arriving (checkpoints keep a layer's
    experts together, so one layer).

    Raises:
        ValueError: an expert id out of range, or experts missing at the end.
    """
    pending: dict[str, tuple[torch.Tensor, set[tuple[int, str]]]] = {}
    for name, tensor in weights:
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        if e >= num_experts:
            raise ValueError(f"{name}: expert {e} of a model with {num_experts} experts")
        down = kind == "down_proj"
        fused = f"{prefix}.{'down_proj' if down else 'gate_up_proj'}"
        if fused not in pending:
            rows = tensor.shape[0] * (1 if down else 2)
            pending[fused] = (tensor.new_empty(num_experts, rows, tensor.shape[1]), set())
        buf, seen = pending[fused]
        rows = tensor.shape[0]
        target = buf[e] if down else buf[e, :rows] if kind == "gate_proj" else buf[e, rows:]
        target.copy_(tensor)
        seen.add((e, kind))
        if len(seen) == num_experts * (1 if down else 2):
            del pending[fused]
            yield fused, buf
    if pending:
        raise ValueError(f"checkpoint lacks per-expert tensors of {sorted(pending)[:4]}")


class Qwen3_5MoeLanguageModel(Qwen3_5LanguageModel):
    """The Qwen3.5-MoE text decoder: :class:`~epdserve.models.qwen3_5_lm.Qwen3_5LanguageModel` (same interface,
    state pool, CUDA paths) with a :class:`SharedExpertMoeBlock` as every layer's ``mlp``.

    ``load_weights`` takes Qwen3.5's names plus ``layers.N.mlp.gate.weight``, ``mlp.shared_expert.{gate,up,down}_proj
    .weight``, ``mlp.shared_expert_gate.weight`` and the experts fused (either layout of :meth:`Experts.load_shard`)
    or one tensor per expert (:func:`fuse_per_expert`).

    Raises:
        ValueError: see :class:`Qwen3_5LanguageModel` and :class:`SharedExpertMoeBlock`.
    """

    @staticmethod
    def _mlp(cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        """Every layer's MLP: a :class:`SharedExpertMoeBlock`."""
        return SharedExpertMoeBlock(cfg, tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`Qwen3_5LanguageModel.load_weights` over :func:`fuse_per_expert` of ``weights``.

        Raises:
            ValueError: see both.
        """
        super().load_weights(fuse_per_expert(weights, self.config.num_experts))
