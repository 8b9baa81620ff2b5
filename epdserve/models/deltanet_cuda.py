"""Gated DeltaNet on CUDA over the :class:`~epdserve.kvcache.state_pool.StatePool`: flash-linear-attention's
(``fla-core``) Triton kernels, the states read and written in place through each request's slot.

Decode (one token per request, inside the decode CUDA graph; no gathered copy of any state):

1. :func:`conv_update`: the causal depthwise conv1d over the slot's last ``kernel`` inputs and the new one, SiLU,
   the window shifted in place in ``pool.conv[layer][slot]``; the output lands split into contiguous q, k, v.
   Our own small Triton kernel, the arithmetic of fla's ``causal_conv1d_update_kernel`` (fla 0.6
   ``fla/modules/causal_conv1d/ops.py``) with the row's state found through its slot: fla's kernel (and
   ``causal-conv1d``'s on the channel-last layout) takes a state per batch row, which would need a gather and a
   scatter of every layer's conv state around it.
2. fla's ``fused_recurrent_kda_fwd`` (fla 0.6 ``fla/ops/kda/fused_recurrent.py``, itself from vLLM's decode
   kernel) with ``ssm_state_indices``: it reads ``pool.recurrent[layer][slot]`` and writes the new state back there.
   Kimi Delta Attention is the gated delta rule with a decay per key feature; given the same decay on every key
   feature it is Gated DeltaNet's recurrence (Yang et al., arXiv:2412.06464) exactly. Its fused gate computes
   ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` and the q/k L2 norms in the kernel, so those
   elementwise ops cost no launches. fla's own gated-delta-rule decode kernel takes no slot indices.
3. The gated RMSNorm (``w * norm(o) * silu(z)``) as one fla ``layer_norm_fwd`` launch per layer.

Extend (prefill, chunked prefill): every request of the batch at once through fla's varlen kernels
(``cu_seqlens``): ``causal_conv1d`` from the slots' conv states, ``chunk_gated_delta_rule`` from their recurrent
states; the final states are written back to the slots. A request's first extend starts from zeros, as a fresh
transformers cache does (:func:`zero_fresh_slots`).

An extend may also take prefix-cache state snapshots on the way (:class:`SnapshotCuts`): the state after the
first ``cut`` new tokens of some requests goes to snapshot slots, from the same forward. The recurrence then runs
twice, once over every token with those requests split at their cuts and once more over the short tails from the
states at the cuts; the conv runs once.

One request's extend inside a prefill CUDA graph (:func:`extend_padded`): the graph has a fixed row count, the
prompt fills the first rows and the rest are padding, and nothing may depend on the real length on the host. fla's
fixed-length kernels run over all rows; the padding rows get ``beta = 0`` and ``g = 0``, which makes the delta
rule's update ``S <- exp(g) S (I - beta k k^T) + beta v k^T`` the identity, so the final state is the state after
the last real row; the conv's outputs on real rows never see the padding after them (it is causal), and its final
window is gathered at the real length on the device.

The kernels compute in float32 from bf16 inputs, so outputs are close to, not bit-equal with, the torch reference
that the CPU tests hold equal to transformers (``tests/test_qwen3_5_gpu.py`` bounds the difference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INSTALL_HINT = "Qwen3.5 on CUDA needs flash-linear-attention's kernels: pip install 'epdserve[hybrid-gpu]'"


def _fla():
    """fla's modules (imported on first use). Raises ImportError naming the extra when fla-core is missing."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.modules.norm.layernorm_gated import layer_norm_fwd
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return causal_conv1d, layer_norm_fwd, chunk_gated_delta_rule, fused_recurrent_kda_fwd


@triton.jit
def _conv_update_kernel(x, state, slots, weight, q, k, v, stride_x, stride_slot,
                        QK: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr):
    i_n, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    o_w = tl.arange(0, BW)
    m_d, m_w = o_d < D, o_w < W
    slot = tl.load(slots + i_n).to(tl.int64)
    b_x = tl.load(x + i_n * stride_x + o_d, mask=m_d, other=0.0)
    # The window: the state's last W - 1 inputs, oldest first, then this token's.
    p_state = state + slot * stride_slot + o_d[:, None] * W + o_w[None, :]
    b_old = tl.load(p_state + 1, mask=m_d[:, None] & (o_w + 1 < W)[None, :], other=0.0)
    b_win = tl.where((o_w == W - 1)[None, :], b_x[:, None], b_old)
    tl.store(p_state, b_win, mask=m_d[:, None] & m_w[None, :])
    b_w = tl.load(weight + o_d[:, None] * W + o_w[None, :], mask=m_d[:, None] & m_w[None, :], other=0.0)
    b_y = tl.sum(b_win.to(tl.float32) * b_w.to(tl.float32), 1)
    b_y = b_y * tl.sigmoid(b_y)
    # Channels q | k | v: each output is contiguous, as the delta-rule kernel reads it.
    tl.store(q + i_n * QK + o_d, b_y, mask=o_d < QK)
    tl.store(k + i_n * QK + (o_d - QK), b_y, mask=(o_d >= QK) & (o_d < 2 * QK))
    tl.store(v + i_n * (D - 2 * QK) + (o_d - 2 * QK), b_y, mask=(o_d >= 2 * QK) & m_d)


def conv_update(x: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                qk_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per request through the causal depthwise conv1d + SiLU, in place on the slots' states.

    Args:
        x: ``[B, D]`` this step's conv inputs (q|k|v channels; rows may be strided, channels contiguous).
        state: ``[num_slots + 1, D, W]`` one layer's conv states (``pool.conv[layer]``), contiguous; row ``slot``
            holds that request's last ``W`` inputs, oldest first. Updated in place: the window shifts by one.
        slots: int64 ``[B]`` each row's slot (padding rows may share the scratch slot).
        weight: ``[D, W]`` the conv weight, contiguous.
        qk_dim: channels of q (and of k); v has ``D - 2 * qk_dim``.

    Returns:
        ``(q, k, v)``: ``[B, qk_dim]``, ``[B, qk_dim]``, ``[B, D - 2 * qk_dim]`` in ``x.dtype``, contiguous.
    """
    B, D = x.shape
    W = weight.shape[-1]
    if x.stride(-1) != 1 or not state.is_contiguous() or not weight.is_contiguous():
        raise ValueError("conv_update needs channel-contiguous x and contiguous state and weight")
    q = torch.empty(B, qk_dim, dtype=x.dtype, device=x.device)
    k = torch.empty_like(q)
    v = torch.empty(B, D - 2 * qk_dim, dtype=x.dtype, device=x.device)
    BD = 256
    _conv_update_kernel[(B, triton.cdiv(D, BD))](x, state, slots, weight, q, k, v, x.stride(0), state.stride(0),
                                                 QK=qk_dim, D=D, W=W, BD=BD, BW=triton.next_power_of_2(W))
    return q, k, v


def decode(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor,
           recurrent_state: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias_k: torch.Tensor,
           heads: tuple[int, int, int, int]) -> torch.Tensor:
    """One decode token per request of a DeltaNet layer: conv, then the gated delta rule, states in place.

    Args:
        mixed: ``[B, conv_dim]`` ``in_proj_qkv``'s output (q|k|v channels).
        a, b: ``[B, hv]`` ``in_proj_a`` / ``in_proj_b`` outputs (the raw decay and beta inputs).
        slots: int64 ``[B]`` state slots.
        conv_state, recurrent_state: this layer's pool tensors ``[num_slots + 1, conv_dim, W]`` and
            ``[num_slots + 1, hv, dk, dv]`` (float32), updated in place.
        conv_weight: ``[conv_dim, W]``. A_log: ``[hv]``. dt_bias_k: ``[hv * dk]``, ``dt_bias`` repeated over
            each head's key features (the kernel reads a bias per key feature).
        heads: ``(hk, hv, dk, dv)``.

    Returns:
        ``[B, hv, dv]`` the layer's core output in ``mixed.dtype``.
    """
    *_, fused_recurrent_kda_fwd = _fla()
    hk, hv, dk, dv = heads
    B = mixed.shape[0]
    q, k, v = conv_update(mixed, conv_state, slots, conv_weight, hk * dk)
    # The per-key-feature decay input: the head's one value on each of its dk features (materialised: the kernel
    # reads g as a contiguous [B, 1, hv, dk]).
    g = a[:, None, :, None].expand(B, 1, hv, dk).contiguous()
    out = torch.empty(B, 1, hv, dv, dtype=mixed.dtype, device=mixed.device)
    fused_recurrent_kda_fwd(
        q=q.view(B, 1, hk, dk), k=k.view(B, 1, hk, dk), v=v.view(B, 1, hv, dv), g=g,
        beta=b.contiguous().view(B, 1, hv), A_log=A_log, dt_bias=dt_bias_k, initial_state=recurrent_state,
        inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, out=out)
    return out.view(B, hv, dv)


def zero_fresh_slots(conv_buffer: torch.Tensor, recurrent_buffer: torch.Tensor, fresh: torch.Tensor) -> None:
    """Zero every layer's states of the ``fresh`` slots (int64 ``[n]``, device): their requests' first extend
    starts from the zero state whatever a previous request left there."""
    if fresh.numel():
        conv_buffer.index_fill_(1, fresh, 0)
        recurrent_buffer.index_fill_(1, fresh, 0)


@dataclass
class SnapshotCuts:
    """Where an extend's state snapshots are cut (``ForwardBatch.state_snapshots``), as index tensors on the device
    that every DeltaNet layer of the forward shares (built once per forward by :meth:`build`).

    The recurrence runs in two varlen calls: the first over every token, with each cut request split into a head
    (its tokens before the cut) and a tail (the rest); the heads' final states are the snapshots. The second runs
    only the tails, from those states; its outputs and final states replace the first call's for the tails. The
    conv needs no split (it is causal and one pass over the whole chunk is right); its window at the cut is
    gathered from the inputs.

    Attributes (int64; ``_cpu``: the same offsets on the host, as fla's varlen kernels want them):
        split_cu, split_cu_cpu: ``[S + 1]`` offsets of the split sequences (S = requests + cuts).
        split_slots: ``[S]`` each split sequence's request slot (a tail's start state is read but not used).
        keep_pos, keep_slots: ``[N - C]`` positions among the split sequences of the requests without a cut, and
            their slots (their final states go back there).
        head_pos, snap_slots, cut_slots: ``[C]`` the cut requests' heads among the split sequences, the snapshot
            slots, and the cut requests' own slots.
        tail_rows: ``[R]`` the tails' rows of the packed tokens; tail_cu, tail_cu_cpu: ``[C + 1]`` their offsets.
        window_rows: ``[C * W]`` for each cut, the rows of ``cat(tokens, cut requests' initial windows)`` that form
            the conv window at the cut (``W`` = the conv kernel).
    """

    split_cu: torch.Tensor
    split_cu_cpu: torch.Tensor
    split_slots: torch.Tensor
    keep_pos: torch.Tensor
    keep_slots: torch.Tensor
    head_pos: torch.Tensor
    snap_slots: torch.Tensor
    cut_slots: torch.Tensor
    tail_rows: torch.Tensor
    tail_cu: torch.Tensor
    tail_cu_cpu: torch.Tensor
    window_rows: torch.Tensor

    @classmethod
    def build(cls, q_lens: list[int], slots: list[int], snapshots, kernel: int, device: torch.device) -> SnapshotCuts:
        """From a batch's ``q_lens``, ``state_slots`` and ``state_snapshots`` (``(request, cut, slot)`` with
        ``0 < cut < q_len``; each request at most once) and the conv kernel size ``W``.

        Raises:
            ValueError: a cut outside ``(0, q_len)`` or a request cut twice.
        """
        cuts = {}
        for i, cut, dst in snapshots:
            if i in cuts or not 0 < cut < q_lens[i]:
                raise ValueError(f"bad state snapshot cut {(i, cut, dst)} for q_lens {q_lens}")
            cuts[int(i)] = (int(cut), int(dst))
        T = sum(q_lens)
        split_cu, split_slots, keep_pos, keep_slots, head_pos, snap_slots, cut_slots = [0], [], [], [], [], [], []
        tail_rows, tail_cu, window_rows = [], [0], []
        base = 0
        for i, (n, slot) in enumerate(zip(q_lens, slots)):
            if i not in cuts:
                keep_pos.append(len(split_slots))
                keep_slots.append(slot)
                split_slots.append(slot)
                split_cu.append(base + n)
            else:
                cut, dst = cuts[i]
                c = len(head_pos)
                head_pos.append(len(split_slots))
                split_slots += [slot, slot]
                split_cu += [base + cut, base + n]
                snap_slots.append(dst)
                cut_slots.append(slot)
                tail_rows += range(base + cut, base + n)
                tail_cu.append(len(tail_rows))
                # The W inputs before the cut: tokens where there are enough of them, else the end of the window
                # the request started from (row T + c * W + w of the concatenation holds its w-th input).
                window_rows += [base + p if p >= 0 else T + c * kernel + kernel + p for p in range(cut - kernel, cut)]
            base += n
        parts = [split_cu, split_slots, keep_pos, keep_slots, head_pos, snap_slots, cut_slots, tail_rows, tail_cu,
                 window_rows]
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
        on_dev = flat.to(device, non_blocking=True).split([len(part) for part in parts])
        return cls(on_dev[0], torch.tensor(split_cu, dtype=torch.int64), *on_dev[1:9],
                   torch.tensor(tail_cu, dtype=torch.int64), on_dev[9])


def extend(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
           cu_seqlens_cpu: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
           conv_weight: torch.Tensor, heads: tuple[int, int, int, int], cuts: SnapshotCuts | None = None
           ) -> torch.Tensor:
    """All requests' new tokens of a DeltaNet layer at once (varlen), continuing each slot's states.

    Args:
        mixed: ``[T, conv_dim]`` the packed tokens' ``in_proj_qkv`` outputs.
        g: float32 ``[T, hv]`` log decays; beta: ``[T, hv]`` (after the sigmoid).
        slots: int64 ``[N]`` the requests' slots; cu_seqlens: int64 ``[N + 1]`` token offsets on the device,
            cu_seqlens_cpu the same on the host.
        conv_state, recurrent_state, conv_weight, heads: as for :func:`decode`; the slots' rows are read as the
            initial states and overwritten with the final ones.
        cuts: state snapshots to take on the way (:class:`SnapshotCuts`): the snapshot slots get the cut requests'
            states at their cuts.

    Returns:
        ``[T, hv, dv]`` in ``mixed.dtype``.
    """
    if cuts is not None:  # before conv_extend replaces the windows the cuts may reach back into
        _snapshot_windows(mixed, cuts, conv_state)
    out = conv_extend(mixed, slots, cu_seqlens, cu_seqlens_cpu, conv_state, conv_weight)
    if cuts is not None:
        return _chunk_rule_cut(out, g, beta, recurrent_state, heads, cuts)
    return _chunk_rule(out, g, beta, slots, recurrent_state, heads, cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu)


def _snapshot_windows(mixed: torch.Tensor, cuts: SnapshotCuts, conv_state: torch.Tensor) -> None:
    """Write each cut's conv window (the last ``W`` inputs before it) into its snapshot slot."""
    D, W = conv_state.shape[1], conv_state.shape[2]
    start = conv_state[cuts.cut_slots]  # [C, D, W]: the windows the cut requests start from
    rows = torch.cat([mixed, start.transpose(1, 2).reshape(-1, D).to(mixed.dtype)])
    windows = rows.index_select(0, cuts.window_rows).view(-1, W, D).transpose(1, 2)
    conv_state.index_copy_(0, cuts.snap_slots, windows.to(conv_state.dtype))


def _chunk_rule_cut(conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, recurrent_state: torch.Tensor,
                    heads: tuple[int, int, int, int], cuts: SnapshotCuts) -> torch.Tensor:
    """:func:`_chunk_rule` over the split sequences, then the tails again from the states at the cuts (see
    :class:`SnapshotCuts`). Returns ``[T, hv, dv]``."""
    dtype = recurrent_state.dtype
    core, final = _rule(conv_out, g, beta, recurrent_state[cuts.split_slots], heads, cu_seqlens=cuts.split_cu,
                        cu_seqlens_cpu=cuts.split_cu_cpu)
    recurrent_state.index_copy_(0, cuts.keep_slots, final.index_select(0, cuts.keep_pos).to(dtype))
    # The tails start from the snapshot as stored (the pool's dtype), as a second forward would.
    at_cut = final.index_select(0, cuts.head_pos).to(dtype)
    recurrent_state.index_copy_(0, cuts.snap_slots, at_cut)
    rows = cuts.tail_rows
    tail, tail_final = _rule(conv_out.index_select(0, rows), g.index_select(0, rows), beta.index_select(0, rows),
                             at_cut, heads, cu_seqlens=cuts.tail_cu, cu_seqlens_cpu=cuts.tail_cu_cpu)
    recurrent_state.index_copy_(0, cuts.cut_slots, tail_final.to(dtype))
    core.index_copy_(0, rows, tail)
    return core


def _chunk_rule(conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                recurrent_state: torch.Tensor, heads: tuple[int, int, int, int], **varlen) -> torch.Tensor:
    """:func:`_rule` from the ``slots``' recurrent states, the final states written back there. Returns
    ``[T, hv, dv]``."""
    core, final = _rule(conv_out, g, beta, recurrent_state[slots], heads, **varlen)
    recurrent_state.index_copy_(0, slots, final.to(recurrent_state.dtype))
    return core


def _rule(conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor,
          heads: tuple[int, int, int, int], **varlen) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked gated delta rule over the conv output ``[T, conv_dim]`` (q|k|v) from ``initial_state``
    ``[N, hv, dk, dv]``, one per sequence; ``varlen``: fla's ``cu_seqlens`` arguments (none: one sequence).
    Returns ``(core [T, hv, dv] in conv_out's dtype, final states [N, hv, dk, dv] float32)``."""
    _, _, chunk_gated_delta_rule, _ = _fla()
    hk, hv, dk, dv = heads
    T = conv_out.shape[0]
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    core, final = chunk_gated_delta_rule(
        q.reshape(1, T, hk, dk), k.reshape(1, T, hk, dk), v.reshape(1, T, hv, dv), g=g[None], beta=beta[None],
        initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True, **varlen)
    return core[0], final


def padding_gates(g: torch.Tensor, beta: torch.Tensor, last_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` and ``beta`` (``[T, hv]``) with every row after ``last_row`` (int64 ``[1]``, device) set to 0: those
    rows then leave the delta rule's state unchanged (see the module docstring)."""
    real = (torch.arange(g.shape[0], device=g.device) <= last_row)[:, None]
    return torch.where(real, g, 0.0), torch.where(real, beta, 0.0)


def conv_padded(mixed: torch.Tensor, slot: torch.Tensor, last_row: torch.Tensor, conv_state: torch.Tensor,
                conv_weight: torch.Tensor) -> torch.Tensor:
    """One request's tokens padded to ``T`` rows through the causal conv1d + SiLU from its slot's window (fla's
    fixed-length ``causal_conv1d``); the slot's window becomes the last ``W`` inputs up to row ``last_row``.

    Args:
        mixed: ``[T, conv_dim]``; rows after ``last_row`` are padding (any values).
        slot: int64 ``[1]`` the request's state slot (device). last_row: int64 ``[1]`` its last real row (device).
        conv_state, conv_weight: as for :func:`decode`.

    Returns:
        ``[T, conv_dim]`` in ``mixed.dtype``; rows after ``last_row`` are not meaningful.
    """
    causal_conv1d, *_ = _fla()
    init = conv_state[slot]  # [1, D, W]
    out, _ = causal_conv1d(mixed[None], weight=conv_weight, initial_state=init, output_final_state=False,
                           activation="silu")
    W = conv_weight.shape[-1]
    # [old window | tokens]: the W inputs ending at real row r are rows r + 1 .. r + W of it.
    full = torch.cat([init[0].T.to(mixed.dtype), mixed], dim=0)
    window = full.index_select(0, last_row + 1 + torch.arange(W, device=mixed.device))  # [W, D]
    conv_state.index_copy_(0, slot, window.T[None].to(conv_state.dtype))
    return out[0]


def extend_padded(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: torch.Tensor,
                  last_row: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                  conv_weight: torch.Tensor, heads: tuple[int, int, int, int]) -> torch.Tensor:
    """One request's new tokens of a DeltaNet layer, padded to a CUDA graph's row count (no host sync, no shape
    that depends on the real length), continuing its slot's states and writing the final ones back.

    Args:
        mixed, g, beta: as for :func:`extend`, ``T`` rows of which rows after ``last_row`` are padding.
        slot: int64 ``[1]`` the request's slot; last_row: int64 ``[1]`` its last real row; both on the device.
        conv_state, recurrent_state, conv_weight, heads: as for :func:`decode`.

    Returns:
        ``[T, hv, dv]`` in ``mixed.dtype``; rows after ``last_row`` are not meaningful.
    """
    out = conv_padded(mixed, slot, last_row, conv_state, conv_weight)
    g, beta = padding_gates(g, beta, last_row)
    return _chunk_rule(out, g, beta, slot, recurrent_state, heads)


def conv_extend(mixed: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                conv_state: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
    """The packed tokens of all requests through the causal conv1d + SiLU (fla's varlen ``causal_conv1d``),
    each continuing its slot's conv window; the slots' windows are replaced by the last ``W`` inputs.

    Args: as :func:`extend`. Returns ``[T, conv_dim]`` in ``mixed.dtype``.
    """
    causal_conv1d, *_ = _fla()
    out, final = causal_conv1d(
        mixed[None], weight=conv_weight, initial_state=conv_state[slots], output_final_state=True,
        activation="silu", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    conv_state[slots] = final.to(conv_state.dtype)
    return out[0]


def gated_norm(core: torch.Tensor, z: torch.Tensor, weight_rep: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNormGated`` in one launch: per head, ``w * rmsnorm(core) * silu(z)`` (float32 inside).

    Args:
        core: ``[N, hv, dv]`` (contiguous). z: ``[N, hv * dv]`` (rows may be strided). weight_rep: ``[hv * dv]``
            the norm weight repeated for each head.

    Returns:
        ``[N, hv * dv]`` in ``core.dtype``.
    """
    _, layer_norm_fwd, _, _ = _fla()
    N, hv, dv = core.shape
    out, _, _ = layer_norm_fwd(core.view(N, hv * dv), weight_rep, None, eps, z=z, group_size=dv,
                               norm_before_gate=True, is_rms_norm=True)
    return out
