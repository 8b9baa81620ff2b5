"""The routed experts' computation of a sparse MoE block: given each token's top-k experts and weights, the weighted
sum of those SiLU-gated experts' outputs. :func:`run_experts` is the one function the blocks call
(:class:`~epdserve.models.qwen3_vl_moe_lm.Experts`); ``method`` picks the implementation:

- ``"loop"`` (:func:`experts_loop`, the CPU default and the reference): one matmul pair per expert the tokens hit,
  the order of transformers' ``Qwen3VLMoeTextExperts``, so float32 outputs equal transformers' bit for bit. It
  reads the hit experts' ids back to the host once per call: not capturable in a CUDA graph.
- ``"grouped"`` (:func:`experts_grouped`, the CUDA default above :data:`~epdserve.models.moe_decode.MAX_SLOTS`):
  slots sorted by expert on the device, one grouped GEMM for gate/up and one for down
  (``torch.nn.functional.grouped_mm``: bf16 on CUDA SM >= 80; float32 too on the CPU). Fixed shapes and no host
  sync, so a decode step (or a prefill graph) can capture it; every expert's weights are read at most once.
- ``"gathered"`` (:func:`experts_gathered`): each slot's expert weights gathered on the device and applied with
  ``torch.bmm``; capturable too, where ``grouped_mm`` is not available (float16 or float32 on CUDA, older GPUs),
  at the price of a ``[T * k, 2I, hidden]`` copy of weights per call: small decode batches only.

- ``"fused"`` (:func:`epdserve.models.moe_decode.experts_fused`): two Triton kernels for a decode-sized batch
  (gate_up + SiLU per slot; down with the routing-weighted sum), against the grouped path's ~25 small kernels
  around its GEMMs; capturable. The CUDA default up to :data:`~epdserve.models.moe_decode.MAX_SLOTS` slots
  (``T * k``), where it measured faster than ``"grouped"`` on an H200 (docs/performance.md, fifteenth session).

A maintained fused-MoE kernel would be one more method here, chosen on CUDA by :func:`default_method`: flashinfer's
``cutlass_fused_moe`` JIT-builds TensorRT-LLM's CUTLASS MoE GEMMs for SM90 (fp8 and fp4 instantiations included) on
first use, a build not yet timed on the device machines; sgl-kernel's wheels are built against other torch releases.

The loop, grouped and gathered methods sum a token's ``k`` expert outputs one at a time in ascending expert id
(what ``index_add_`` in the loop does), so they differ from the loop only by the GEMMs' own rounding; the fused
method sums them in float32 and rounds once.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from epdserve.models.moe_decode import MAX_SLOTS

METHODS = ("loop", "grouped", "gathered", "fused")


def default_method(x: torch.Tensor, slots: int) -> str:
    """The method for ``x`` ``[T, hidden]`` and ``slots = T * k``: ``"loop"`` on the CPU (the reference; no graphs
    there); on CUDA ``"fused"`` for bf16/fp16 up to :data:`~epdserve.models.moe_decode.MAX_SLOTS` slots (decode
    batches), ``"grouped"`` for bf16 above (``grouped_mm``'s case), ``"gathered"`` otherwise."""
    if not x.is_cuda:
        return "loop"
    if x.dtype in (torch.bfloat16, torch.float16) and slots <= MAX_SLOTS:
        return "fused"
    return "grouped" if x.dtype == torch.bfloat16 else "gathered"


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor, method: str | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = experts[t, j]``.

    Args:
        x: ``[T, hidden]`` activations.
        gate_up: ``[E, 2I, hidden]`` (each expert's gate rows, then its up rows; ``x``'s dtype).
        down: ``[E, hidden, I]``.
        weights: ``[T, k]`` routing weights (``x``'s dtype).
        experts: ``[T, k]`` int64 expert ids in ``[0, E)``, distinct within a row.
        method: ``"loop"``, ``"grouped"``, ``"gathered"`` or ``"fused"`` (see the module docstring); None:
            :func:`default_method`.

    Returns:
        ``[T, hidden]`` in ``x``'s dtype (a TP rank's partial sum when the weights hold its intermediate slice).

    Raises:
        ValueError: an unknown ``method``.
    """
    method = method or default_method(x, experts.numel())
    if method == "loop":
        return experts_loop(x, gate_up, down, weights, experts)
    if method == "grouped":
        return experts_grouped(x, gate_up, down, weights, experts)
    if method == "gathered":
        return experts_gathered(x, gate_up, down, weights, experts)
    if method == "fused":
        from epdserve.models.moe_decode import experts_fused

        return experts_fused(x, gate_up, down, weights, experts)
    raise ValueError(f"unknown experts method {method!r}; expected one of {METHODS}")


def experts_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
    """:func:`run_experts` by a loop over the experts the tokens hit, in ascending id, each one's weighted output
    added with ``index_add_`` (transformers' order: float32 sums match it bit for bit). One host sync."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():  # sorted ascending; the host sync
        # Rows slot-major, as transformers' [E, k, T] expert mask gives them: a GEMM's rounding of a row can depend
        # on where in the batch it sits (CPU kernels treat a partial tail tile differently).
        slot, tok = torch.where((experts == e).T)
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _ascending(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)`` ``[T, k]`` with each row reordered by ascending expert id: the loop's summation order."""
    experts, order = experts.sort(dim=1)
    return weights.gather(1, order), experts


def _sum_slots(y: torch.Tensor, k: int) -> torch.Tensor:
    """``[T * k, hidden]`` slot outputs (token-major) -> ``[T, hidden]``, adding a token's ``k`` slots one by one
    in slot order (a sum kernel would reorder the adds)."""
    y = y.view(-1, k, y.shape[-1])
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """:func:`run_experts` with grouped GEMMs over slots sorted by expert; no host sync, fixed shapes (capturable).

    Shapes: the ``S = T * k`` slots (token-major, each token's slots by ascending expert id: the loop's summation
    order) are sorted by expert id, then, as the loop takes them, by the slot's top-k position, then by token;
    ``ends`` int32 ``[E]`` is each expert's end offset in that order (``searchsorted``, so experts no
    token chose get empty groups); ``grouped_mm`` of the sorted rows ``[S, hidden]`` with ``gate_up`` viewed as
    ``[E, hidden, 2I]`` gives ``[S, 2I]``, and of ``silu(gate) * up`` ``[S, I]`` with ``down`` viewed as
    ``[E, I, hidden]`` gives ``[S, hidden]``; each row is scaled by its weight and put back in slot order.
    ``grouped_mm`` needs bf16 on CUDA (SM >= 80) and 16-byte aligned row strides (``hidden`` and ``I`` multiples
    of 8 in bf16, of 4 in float32).
    """
    k = experts.shape[1]
    experts, position = experts.sort(dim=1)  # position[t, i]: the top-k slot the i-th smallest expert came from
    weights = weights.gather(1, position)
    flat = experts.reshape(-1)
    by_expert = (flat * k + position.reshape(-1)).argsort(stable=True)  # [S]: by expert, top-k slot, token
    ids = torch.arange(gate_up.shape[0], device=x.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat[by_expert], ids, right=True).to(torch.int32)
    h = F.grouped_mm(x[by_expert // k], gate_up.transpose(1, 2), offs=ends)
    g, u = h.chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=ends) * weights.reshape(-1)[by_expert, None]
    slots = torch.empty_like(y).index_copy_(0, by_expert, y)
    return _sum_slots(slots, k).to(x.dtype)


def experts_gathered(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     experts: torch.Tensor) -> torch.Tensor:
    """:func:`run_experts` with each slot's expert weights gathered on the device and ``torch.bmm``; no host sync,
    fixed shapes (capturable), any dtype.

    Shapes: ``S = T * k`` slots (token-major); ``gate_up[ids]`` ``[S, 2I, hidden]`` times the slot's row
    ``[S, hidden, 1]`` gives ``[S, 2I]``; ``down[ids]`` ``[S, hidden, I]`` times ``silu(gate) * up``
    ``[S, I, 1]`` gives ``[S, hidden]``. The gathered copies cost ``S * 3 * I * hidden`` elements a call.
    """
    k = experts.shape[1]
    weights, experts = _ascending(weights, experts)
    flat = experts.reshape(-1)
    rows = x.repeat_interleave(k, dim=0)  # [S, hidden]: token t's row for each of its slots
    g, u = torch.bmm(gate_up[flat], rows[:, :, None])[..., 0].chunk(2, dim=-1)
    y = torch.bmm(down[flat], (F.silu(g) * u)[:, :, None])[..., 0] * weights.reshape(-1, 1)
    return _sum_slots(y, k).to(x.dtype)
