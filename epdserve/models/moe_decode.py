"""The routed experts of a decode-sized batch in two Triton kernels: gate_up + SiLU per slot, then down with the
routing-weighted sum of each token's slots (``run_experts``' ``"fused"`` method, issue 50).

Why: on an H200, Qwen3-VL-30B-A3B's shapes (128 experts, top 8, expert width 768, hidden 2048) decoded one row in
~170 us per layer against ~28 us of bytes (docs/performance.md, fourteenth session). The ``"grouped"`` path spends
a decode step on ~25 small kernels per layer around its two grouped GEMMs (sort, argsort, searchsorted, gathers,
SiLU, the weight multiply, the scatter back, seven slot adds). Here a layer's experts are two launches, as SGLang's
and vLLM's Triton ``fused_moe`` kernels do it for small batches, without their block alignment (one slot per
program row: at a few tokens nearly every slot has its own expert):

- :func:`_kernel` ``[0]``, grid ``(S, cdiv(I, BN))`` over the ``S = T * k`` slots: program ``(s, n)`` reads slot
  ``s``'s expert id and its token's row, and writes ``silu(x @ Wg.T) * (x @ Wu.T)`` for ``BN`` intermediate
  columns; gate and up are each rounded to the activation dtype first (what the grouped GEMM's bf16 output does).
- ``[1]``, grid ``(T, cdiv(hidden, BN))``: program ``(t, n)`` adds ``weight_j * (act_j @ Wd_j.T)`` over token
  ``t``'s ``k`` slots for ``BN`` output columns in float32 and rounds once. It holds its ``k * BN`` weight rows
  over the whole ``I`` in registers and loads them under programmatic dependent launch (PDL,
  :func:`epdserve.device.supports_pdl`) before it waits for the gate_up kernel, as
  :mod:`epdserve.models.decode_gemv` does for the dense projections: the down weights (a third of the experts'
  bytes) stream while gate_up runs. The first version looped over the slots with a 128-wide K step after the
  launch: at one token 15.5 us for 25 MB, 1.6 TB/s (docs/performance.md, fifteenth session).

The three kernels launch under PDL (the routing kernel and gate_up wait first thing: what they read comes from the
kernel right before them).

:func:`route_fused` is the router's softmax, top-k and renormalisation in one kernel after the router GEMM (five
launches fewer per layer than :func:`~epdserve.models.qwen3_vl_moe_lm.route`'s torch ops).

Arithmetic: products accumulate in float32. The ``k`` slot outputs are summed in float32 (a pairwise reduction
over the slots) and rounded once, where the loop and the grouped path add bf16 results in ascending expert id; so
this method equals them up to float rounding, not bit for bit (it is the more exact of the two). A slot's expert
weights are read by its own programs: two tokens on one expert read it twice, which at the few tokens this is for
costs little against the kernels it saves; larger batches take the grouped GEMMs (:data:`MAX_SLOTS`).

Shapes and dtypes: ``x`` ``[T, hidden]``; ``gate_up`` ``[E, 2I, hidden]`` (gate rows then up rows); ``down``
``[E, hidden, I]``; ``weights`` ``[T, k]`` (``x``'s dtype); ``experts`` ``[T, k]`` int64 in ``[0, E)``; output
``[T, hidden]`` in ``x``'s dtype. bf16/fp16 on CUDA, float32 too on the CPU through Triton's interpreter (the tests).
No host sync, fixed shapes: CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch

from epdserve.device import supports_pdl

# T * k up to which run_experts' default on CUDA is this method: 16 tokens of Qwen3-VL-30B-A3B, where it took 0.82x
# the grouped path's time on an H200 (1.06x at 32 tokens; docs/performance.md, fifteenth session)
MAX_SLOTS = 128
# Launch options of the gate_up kernel: BN columns per program, a K step of BK, warps and software-pipeline stages.
# Chosen on an H200 from a sweep over BN, BK, warps and stages at 1-16 tokens (30B-A3B shapes, 12 layers per CUDA
# graph): against the first choice (BN 32, BK 128, 4 warps, 3 stages) it took 0.61-0.86x the time (docs/performance.md,
# fifteenth session).
GATE_UP_LAUNCH = dict(BN=32, BK=128, num_warps=8, num_stages=4)
# The down kernel holds a program's whole weight tile, KP * BN rows of the padded width, in registers (it loads them
# before its PDL wait): at most this many elements a program, 128 a thread. The 30B-A3B (k = 8, I = 768 padded to
# 1024): BN = 2, 1,024 programs of 24 KB at one token.
DOWN_TILE = 16384
DOWN_MAX_BN = 2


def down_launch(top_k: int, inter: int) -> dict:
    """The down kernel's constexprs and warps for ``top_k`` slots of width ``inter``: ``KP`` (top_k to a power of
    two), ``BK`` (inter to a power of two, >= 16), ``BN`` (columns a program, as many as :data:`DOWN_TILE` allows,
    at most :data:`DOWN_MAX_BN`) and ``num_warps`` (4, more where one column's tile alone is larger)."""
    kp, bk = 1 << (top_k - 1).bit_length(), max(16, 1 << (inter - 1).bit_length())
    bn = max(1, min(DOWN_MAX_BN, DOWN_TILE // (kp * bk)))
    return dict(KP=kp, BK=bk, BN=bn, num_warps=min(16, max(4, kp * bn * bk // (32 * 128))))


@functools.cache
def _kernel():
    """The jitted ``(gate_up_silu_slots, down_weighted_sum, softmax_topk)``; Triton imported on first use."""
    import triton
    import triton.language as tl

    return _gate_up_kernel(triton, tl), _down_kernel(triton, tl), _routing_kernel(triton, tl)


def _gate_up_kernel(triton, tl):
    @triton.jit
    def gate_up_silu_slots(x, w, experts, act, K, I, x_stride, w_e_stride, w_n_stride, act_stride,
                           TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # the expert ids come from the kernel right before: nothing to load ahead of the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        s = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        col_ok = cols < I
        e = tl.load(experts + s).to(tl.int64)
        row = x + (s // TOPK) * x_stride
        gate_ptrs = w + e * w_e_stride + cols[:, None].to(tl.int64) * w_n_stride + ks[None, :]
        up_ptrs = gate_ptrs + I * w_n_stride
        # [BN, BK] float32 partial products, reduced once after the K loop (one cross-thread reduction, not one
        # per step)
        acc_g = tl.full((BN, BK), 0.0, tl.float32)
        acc_u = tl.full((BN, BK), 0.0, tl.float32)
        for k0 in range(0, K, BK):
            k_ok = (k0 + ks) < K
            a = tl.load(row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            ok = col_ok[:, None] & k_ok[None, :]
            acc_g += tl.load(gate_ptrs + k0, mask=ok, other=0.0).to(tl.float32) * a[None, :]
            acc_u += tl.load(up_ptrs + k0, mask=ok, other=0.0).to(tl.float32) * a[None, :]
        dt = act.dtype.element_ty
        # tl.sum's own combine function: tl.sum itself does not run on the CPU interpreter
        g = tl.reduce(acc_g, 1, tl.standard._sum_combine).to(dt).to(tl.float32)
        u = tl.reduce(acc_u, 1, tl.standard._sum_combine).to(dt).to(tl.float32)
        tl.store(act + s * act_stride + cols, (g / (1.0 + tl.exp(-g)) * u).to(dt), mask=col_ok)

    return gate_up_silu_slots


def _down_kernel(triton, tl):
    @triton.jit
    def down_weighted_sum(act, w, experts, weights, out, I, N, act_stride, w_e_stride, w_n_stride, out_stride,
                          TOPK: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          PDL: tl.constexpr):
        # Program (t, n): BN output columns of token t. Row r of its [KP * BN, BK] tile is slot r // BN's expert's
        # column n * BN + r % BN over the whole I (BK >= I). The ids and routing weights were written two kernels
        # back, by the router, which completed before the gate_up kernel passed its own wait, and that kernel
        # lets this one start only after that wait: so the expert weights stream in before this wait, while
        # gate_up still runs. Only the activations (a few KB, from L2) come after it.
        t = tl.program_id(0)
        r = tl.arange(0, KP * BN)
        j = r // BN
        cols = tl.program_id(1) * BN + r % BN
        ks = tl.arange(0, BK)
        ok = ((j < TOPK) & (cols < N))[:, None] & (ks < I)[None, :]
        e = tl.load(experts + t * TOPK + j, mask=j < TOPK, other=0).to(tl.int64)
        wt = tl.load(w + e[:, None] * w_e_stride + cols[:, None].to(tl.int64) * w_n_stride + ks[None, :], mask=ok,
                     other=0.0)
        rw = tl.load(weights + t * TOPK + j, mask=j < TOPK, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(act + (t * TOPK + j)[:, None] * act_stride + ks[None, :], mask=ok, other=0.0)
        y = tl.reduce(wt.to(tl.float32) * a.to(tl.float32), 1, tl.standard._sum_combine) * rw
        total = tl.reduce(tl.reshape(y, (KP, BN)), 0, tl.standard._sum_combine)
        out_cols = tl.program_id(1) * BN + tl.arange(0, BN)
        tl.store(out + t * out_stride + out_cols, total.to(out.dtype.element_ty), mask=out_cols < N)

    return down_weighted_sum


def _routing_kernel(triton, tl):
    @triton.jit
    def softmax_topk(logits, weights, experts, E, stride, TOPK: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr,
                     PDL: tl.constexpr):
        if PDL:  # the logits are the kernel before's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # One row: float32 softmax over the E router logits, the top k by repeated argmax (the lowest id first
        # among equal probabilities), renormalised over those k; the picks stay in registers until one store each.
        t = tl.program_id(0)
        ids = tl.arange(0, BE)
        z = tl.load(logits + t * stride + ids, mask=ids < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - tl.reduce(z, 0, tl.standard._elementwise_max))
        left = tl.where(ids < E, p / tl.reduce(p, 0, tl.standard._sum_combine), -1.0)
        slot = tl.arange(0, KP)
        pick_id = tl.full((KP,), 0, tl.int32)
        pick_p = tl.full((KP,), 0.0, tl.float32)
        for j in tl.static_range(TOPK):
            top = tl.reduce(left, 0, tl.standard._elementwise_max)
            first = tl.reduce(tl.where(left == top, ids, BE), 0, tl.standard._elementwise_min)
            pick_id = tl.where(slot == j, first, pick_id)
            pick_p = tl.where(slot == j, top, pick_p)
            left = tl.where(ids == first, -1.0, left)
        total = tl.reduce(pick_p, 0, tl.standard._sum_combine)
        tl.store(experts + t * TOPK + slot, pick_id.to(tl.int64), mask=slot < TOPK)
        tl.store(weights + t * TOPK + slot, (pick_p / total).to(weights.dtype.element_ty), mask=slot < TOPK)

    return softmax_topk


def route_fused(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`epdserve.models.qwen3_vl_moe_lm.route_torch` with the router GEMM then one Triton kernel for the float32
    softmax, the top k (repeated argmax; ties to the lowest id) and the renormalisation: ``[T, k]`` weights in
    ``x``'s dtype and int64 ids, in descending probability. Up to float rounding of the softmax (Triton's ``exp``
    against torch's), the same routing; a top-k tie between two experts may pick the other one than ``torch.topk``.

    Raises:
        ValueError: more than 1024 experts or fewer than ``top_k``.
    """
    return route_logits(torch.nn.functional.linear(x, gate_weight), top_k)


def route_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_fused` from the router's logits ``[T, E]`` (their dtype is the weights')."""
    T, E = logits.shape
    if not top_k <= E <= 1024:
        raise ValueError(f"route_fused takes top_k <= experts <= 1024, got {top_k} of {E}")
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        pdl = supports_pdl(logits.device)
        _kernel()[2][(T,)](logits, weights, experts, E, logits.stride(0), TOPK=top_k,
                           BE=max(16, 1 << (E - 1).bit_length()), KP=max(2, 1 << (top_k - 1).bit_length()), PDL=pdl,
                           launch_pdl=pdl)
    return weights, experts


def experts_fused(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor) -> torch.Tensor:
    """:func:`~epdserve.models.moe_experts.run_experts` in two launches (module docstring): ``[T, hidden]`` in
    ``x``'s dtype.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, or rows that are not contiguous.
    """
    (T, hidden), (E, two_i, _), k = x.shape, gate_up.shape, experts.shape[1]
    inter = two_i // 2
    if (gate_up.shape[2] != hidden or down.shape != (E, hidden, inter) or weights.shape != experts.shape
            or experts.shape[0] != T or two_i % 2):
        raise ValueError(f"fused experts need x [T, H], gate_up [E, 2I, H], down [E, H, I], weights and experts "
                         f"[T, k]; got {list(x.shape)}, {list(gate_up.shape)}, {list(down.shape)}, "
                         f"{list(weights.shape)}, {list(experts.shape)}")
    if len({t.dtype for t in (x, gate_up, down, weights)}) != 1 or len({t.device for t in (x, gate_up, down,
                                                                                           weights, experts)}) != 1:
        raise ValueError("fused experts need x, gate_up, down and weights of one dtype, every tensor on one device")
    if min(x.stride(1), gate_up.stride(2), down.stride(2)) != 1:
        raise ValueError("fused experts need rows of x, gate_up and down contiguous")
    out = torch.empty_like(x)
    if T == 0:
        return out
    experts, weights = experts.contiguous(), weights.contiguous()
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    first, second, _ = _kernel()
    pdl = supports_pdl(x.device)
    first[(T * k, -(-inter // GATE_UP_LAUNCH["BN"]))](x, gate_up, experts, act, hidden, inter, x.stride(0),
                                                      gate_up.stride(0), gate_up.stride(1), act.stride(0), TOPK=k,
                                                      PDL=pdl, launch_pdl=pdl, **GATE_UP_LAUNCH)
    launch = down_launch(k, inter)
    second[(T, -(-hidden // launch["BN"]))](act, down, experts, weights, out, inter, hidden, act.stride(0),
                                            down.stride(0), down.stride(1), out.stride(0), TOPK=k, PDL=pdl,
                                            launch_pdl=pdl, **launch)
    return out
