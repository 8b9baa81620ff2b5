"""The CUDA DeltaNet kernels' arithmetic (:mod:`epdserve.models.deltanet_cuda`) checked on the CPU, under Triton's
interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable must be set before Triton is imported), against
transformers' torch references that the model tests hold equal to transformers' Qwen3.5, in float32:

- decode: our slot-indexed conv update and fla's continuous-batching recurrent kernel with the gate, beta and q/k
  L2 norms fused, over three steps, states read and written in place through the slots (grouped heads, strided
  input rows, slots out of order, two padding rows sharing the scratch slot);
- extend: fla's varlen conv over several requests from their slots' windows (fresh, continued, one token), and the
  final windows written back; fla's chunked delta rule (made to run under the interpreter by a one-line edit of the
  test's own copy of fla, :data:`_INTERPRETER_EDITS`) is checked through the extends below (tests/test_qwen3_5_gpu.py
  checks it on a GPU);
- an extend that takes prefix-cache state snapshots on the way (:class:`~epdserve.models.deltanet_cuda.SnapshotCuts`)
  against two extends with the snapshots copied between them; then the same through the tiny Qwen3.5 model with
  its DeltaNet layers on the kernels (``ForwardBatch.state_snapshots`` in one forward against two forwards and a
  state copy, as the prefill server did before): logits and every request's and snapshot's states;
- a prefill CUDA graph's padded extend: the conv's real rows and the window gathered at the real length, whatever
  the padding rows hold; and (without the interpreter) that the padding's gates leave the delta rule's state as
  the last real row left it, on transformers' chunked reference;
- the gated RMSNorm.

fla-core is not in the test environment: where it imports, transformers' own Qwen3.5 (the parity reference) calls
its Triton kernels even on the CPU, and they fail without a GPU. So this test installs it into a folder of its
own (cached in the temp folder) that only its subprocess sees, and skips when Triton or the registry is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

FLA = ("fla-core==0.6.0", "einops==0.8.2")  # the hybrid-gpu extra's range, pinned for a stable cache


# Triton's interpreter runs a kernel's ``range`` loops with Python ints, which have no ``.to``: the one place fla's
# chunked delta rule relies on it (its state-passing kernel, fla 0.6 ``fla/ops/common/chunk_delta_h.py``) is
# rewritten into the same cast, so the rule runs under the interpreter too.
_INTERPRETER_EDITS = {"fla/ops/common/chunk_delta_h.py": ("i_t.to(tl.int64)", "tl.full([], i_t, tl.int64)")}


def _for_the_interpreter(site: Path) -> None:
    for rel, (old, new) in _INTERPRETER_EDITS.items():
        path = site / rel
        text = path.read_text()
        if old in text:
            path.write_text(text.replace(old, new))


def _fla_site() -> str:
    """A folder holding fla-core (and einops), installed once per version into the temp folder, with the edits
    Triton's interpreter needs (:data:`_INTERPRETER_EDITS`)."""
    site = Path(tempfile.gettempdir()) / ("epdserve-" + "-".join(FLA).replace("==", "-"))
    if (site / "ready").exists():
        _for_the_interpreter(site)
        return str(site)
    build = Path(tempfile.mkdtemp(prefix=f"{site.name}-", dir=site.parent))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(build), *FLA],
                         capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"cannot install {' '.join(FLA)} from the package registry: {pip.stderr[-500:]}")
    _for_the_interpreter(build)
    (build / "ready").touch()
    try:
        os.rename(build, site)  # atomic: a concurrent run sees a whole folder or none
    except OSError:
        pass  # another run got there first
    return str(site)


def test_kernels_equal_the_torch_references_under_the_triton_interpreter():
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (_fla_site(), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(run.stdout)
    for part in ("decode", "extend conv", "padded conv", "snapshot extend", "snapshot forward", "gated norm"):
        assert f"{part} ok" in run.stdout, run.stdout


def test_padding_gates_leave_the_delta_rule_state_unchanged():
    """The padded graph extend's premise, on transformers' chunked gated-delta-rule reference: rows after the
    real ones with ``g = beta = 0`` (whatever their q, k, v) change neither the real rows' outputs nor the final
    state, across a 64-token chunk boundary and within one."""
    pytest.importorskip("triton")
    import inspect

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from epdserve.models.deltanet_cuda import padding_gates

    rule = inspect.unwrap(m.torch_chunk_gated_delta_rule)
    torch.manual_seed(0)
    h, dk, dv = 2, 16, 8
    for L, T in ((50, 64), (70, 128), (64, 80)):
        q, k, v = torch.randn(1, T, h, dk), torch.randn(1, T, h, dk), torch.randn(1, T, h, dv)
        g, beta = -torch.rand(T, h), torch.rand(T, h)
        state = torch.randn(1, h, dk, dv)
        want, want_state = rule(q[:, :L], k[:, :L], v[:, :L], g=g[None, :L], beta=beta[None, :L],
                                initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        gp, bp = padding_gates(g, beta, torch.tensor([L - 1]))
        assert (gp[L:] == 0).all() and (bp[L:] == 0).all() and torch.equal(gp[:L], g[:L])
        got, got_state = rule(q, k, v, g=gp[None], beta=bp[None], initial_state=state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(got[:, :L], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
        # Without the gates zeroed the padding does change the state: the check can fail.
        _, moved = rule(q, k, v, g=g[None], beta=beta[None], initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        assert (moved - want_state).abs().max() > 1e-2


def _check() -> None:
    import inspect

    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from triton.runtime.autotuner import Autotuner

    # The interpreter has no device to time configs on (autotuning raises), and a config changes only the tiling,
    # not the result: take the first.
    Autotuner.prune_configs = lambda self, kwargs, *args: self.configs[:1]

    from epdserve.models import deltanet_cuda as dc

    conv_update = inspect.unwrap(m.causal_conv1d_update)
    conv_fn = inspect.unwrap(m.causal_conv1d_fn)
    recurrent_rule = inspect.unwrap(m.torch_recurrent_gated_delta_rule)
    torch.manual_seed(0)
    hk, hv, dk, dv, W, S = 2, 4, 16, 16, 4, 6
    D = 2 * hk * dk + hv * dv
    weight = torch.randn(D, W) * 0.3
    A_log, dt_bias = torch.randn(hv) * 0.1, torch.randn(hv)
    tol = 1e-5

    def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = float((got - want).abs().max())
        assert err <= tol * max(1.0, float(want.abs().max())), f"{name}: max |difference| {err:.3g}"

    # Decode. Rows 3 and 4 are CUDA-graph padding: both on the scratch slot S; the reference skips them.
    conv, rec = torch.randn(S + 1, D, W), torch.randn(S + 1, hv, dk, dv)
    conv_ref, rec_ref = conv.clone(), rec.clone()
    slots = torch.tensor([4, 0, 2, S, S])
    real = slots[:3]
    for _ in range(3):
        mixed = torch.randn(5, D + 9)[:, :D]  # strided rows, as a split of the fused input projection
        a, b = torch.randn(5, hv), torch.randn(5, hv)
        got = dc.decode(mixed, a, b, slots, conv, rec, weight, A_log, dt_bias.repeat_interleave(dk), (hk, hv, dk, dv))
        window = conv_ref[real]
        out = conv_update(mixed[:3, :, None].contiguous(), window, weight, None, "silu")[..., 0]
        conv_ref[real] = window
        q, k, v = out.split([hk * dk, hk * dk, hv * dv], -1)
        q, k = (x.reshape(3, 1, hk, dk).repeat_interleave(hv // hk, 2) for x in (q, k))
        g = -A_log.exp() * F.softplus(a[:3] + dt_bias)
        want, state = recurrent_rule(q, k, v.reshape(3, 1, hv, dv), g=g[:, None], beta=b[:3].sigmoid()[:, None],
                                     initial_state=rec_ref[real], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        rec_ref[real] = state
        close("decode output", got[:3], want[:, 0])
        close("decode conv states", conv[:S], conv_ref[:S])
        close("decode recurrent states", rec[:S], rec_ref[:S])
    print("decode ok")

    # Extend: a fresh request (zeroed first, as the model does), one continuing past W tokens, one single token.
    lens, slots = [5, 70, 1], torch.tensor([1, 3, 0])
    conv_buf = torch.randn(1, S + 1, D, W)
    dc.zero_fresh_slots(conv_buf, torch.zeros(1, S + 1, 1), slots[:1])
    conv_ref = conv_buf[0].clone()
    mixed = torch.randn(sum(lens), D)
    cu = torch.tensor([0, *lens]).cumsum(0)
    got = dc.conv_extend(mixed, slots, cu, cu, conv_buf[0], weight)
    wants, start = [], 0
    for n, slot in zip(lens, slots.tolist()):
        full = torch.cat([conv_ref[slot:slot + 1], mixed[start:start + n].T[None]], -1)
        conv_ref[slot] = full[0, :, -W:]
        wants.append(conv_fn(full, weight, None, activation="silu")[0, :, -n:].T)
        start += n
    close("extend conv output", got, torch.cat(wants))
    close("extend conv states", conv_buf[0], conv_ref)
    print("extend conv ok")

    # A prefill CUDA graph's extend: 37 real rows continuing slot 2's window, padded to 48 rows (garbage).
    L, T, slot = 37, 48, torch.tensor([2])
    conv_buf = torch.randn(S + 1, D, W)
    conv_ref = conv_buf.clone()
    mixed = torch.cat([torch.randn(L, D), torch.randn(T - L, D) * 100])
    got = dc.conv_padded(mixed, slot, torch.tensor([L - 1]), conv_buf, weight)
    full = torch.cat([conv_ref[2:3], mixed[:L].T[None]], -1)
    conv_ref[2] = full[0, :, -W:]
    close("padded conv output", got[:L], conv_fn(full, weight, None, activation="silu")[0, :, -L:].T)
    close("padded conv states", conv_buf, conv_ref)
    print("padded conv ok")

    # An extend taking prefix-cache snapshots on the way (SnapshotCuts), fla's chunked rule and all, against two
    # extends with the snapshots copied between them: the split sequences, the tails rerun from the cut states and
    # the windows at the cuts must give the same outputs and states.
    heads = (hk, hv, dk, dv)
    lens, slot_list = [20, 9, 70, 6], [1, 3, 0, 5]
    snaps = [(0, 16, 2), (2, 2, 4)]  # request 2's cut is 2 tokens in: its window reaches into its start window
    mixed = torch.randn(sum(lens), D + 5)[:, :D]
    g, beta = -torch.rand(sum(lens), hv), torch.rand(sum(lens), hv)
    conv_buf, rec_buf = torch.randn(S + 1, D, W), torch.randn(S + 1, hv, dk, dv)
    conv_ref, rec_ref = conv_buf.clone(), rec_buf.clone()
    cu = torch.tensor([0, *lens]).cumsum(0)
    slots = torch.tensor(slot_list)
    cuts = dc.SnapshotCuts.build(lens, slot_list, snaps, W, torch.device("cpu"))
    got = dc.extend(mixed, g, beta, slots, cu, cu, conv_buf, rec_buf, weight, heads, cuts=cuts)
    # The reference: the heads (and the requests without a cut) in one extend, the snapshots copied, the tails in a
    # second extend: what two forwards did.
    cut_at = {i: c for i, c, _ in snaps}
    head_lens = [cut_at.get(i, n) for i, n in enumerate(lens)]
    head_rows = torch.cat([torch.arange(a, a + h) for a, h in zip(cu[:-1].tolist(), head_lens)])
    hcu = torch.tensor([0, *head_lens]).cumsum(0)
    want = torch.empty_like(got)
    want[head_rows] = dc.extend(mixed[head_rows], g[head_rows], beta[head_rows], slots, hcu, hcu, conv_ref, rec_ref,
                                weight, heads)
    for i, _, dst in snaps:
        conv_ref[dst], rec_ref[dst] = conv_ref[slot_list[i]], rec_ref[slot_list[i]]
    tails = [i for i, _, _ in snaps]
    tail_rows = torch.cat([torch.arange(cu[i] + cut_at[i], cu[i + 1]) for i in tails])
    tcu = torch.tensor([0, *(lens[i] - cut_at[i] for i in tails)]).cumsum(0)
    want[tail_rows] = dc.extend(mixed[tail_rows], g[tail_rows], beta[tail_rows], slots[tails], tcu, tcu, conv_ref,
                                rec_ref, weight, heads)
    close("snapshot extend output", got, want)
    close("snapshot extend conv states", conv_buf, conv_ref)
    close("snapshot extend recurrent states", rec_buf, rec_ref)
    assert not torch.equal(rec_buf[2], rec_buf[1]) and not torch.equal(conv_buf[4], conv_buf[0])  # cut mid-way
    print("snapshot extend ok")

    _check_snapshot_forward()
    print("snapshot forward ok")

    core, z, w = torch.randn(7, hv, dv), torch.randn(7, hv * dv + 3)[:, :hv * dv], torch.randn(dv)
    x = core.reshape(-1, dv)
    want = (w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z.reshape(-1, dv))).reshape(7, -1)
    close("gated norm", dc.gated_norm(core, z, w.repeat(hv), 1e-6), want)
    print("gated norm ok")


def _check_snapshot_forward() -> None:
    """The tiny Qwen3.5 on the CPU with its DeltaNet layers on the kernels: three prompts (one too short for a
    snapshot) prefilled in one forward that takes the snapshots at their last page boundaries, against two forwards
    (up to the cuts, the states copied to the snapshot slots, then the rest)."""
    import tempfile

    import torch
    from test_model_runtime import Pages, Seq, make_batch

    from epdserve.engine.forward_batch import ForwardBatch
    from epdserve.engine.model_runner import ModelRunner
    from epdserve.models.qwen3_5_deltanet import GatedDeltaNet
    from epdserve.models.tiny import make_tiny_model

    page = 16
    path = make_tiny_model(tempfile.mkdtemp(prefix="tiny-qwen3.5-"), arch="qwen3.5")
    runner = ModelRunner(str(path), device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=page,
                         num_state_slots=8)
    runner.model.deltanet_kernels = True
    for m in runner.model.modules():
        if isinstance(m, GatedDeltaNet):
            m.use_kernels(True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200, (n,), generator=gen).tolist() for n in (3, 40, 90)]
    cuts = [(len(ids) - 1) // page * page for ids in prompts]  # 0, 32, 80

    def forward(seqs, slots, parts, snapshots=None):
        b = make_batch(parts)
        return runner.forward(ForwardBatch(b.is_decode, b.input_ids, b.positions, b.out_slots, b.q_lens, b.kv_lens,
                                           b.page_table, state_slots=slots, state_snapshots=snapshots)).float()

    runs = []
    for one_forward in (False, True):
        pages = Pages(runner.num_pages)
        seqs = [Seq(ids, [], pages.take(8), page) for ids in prompts]
        slots = [runner.state_pool.alloc() for _ in prompts]
        snaps = [runner.state_pool.alloc() if c else -1 for c in cuts]
        if one_forward:
            last = forward(seqs, slots, [s.extend_part(len(ids)) for s, ids in zip(seqs, prompts)],
                           [(i, c, dst) for i, (c, dst) in enumerate(zip(cuts, snaps)) if c])
        else:
            last = forward(seqs, slots, [s.extend_part(c or len(ids)) for s, c, ids in zip(seqs, cuts, prompts)])
            cut = [i for i, c in enumerate(cuts) if c]
            for i in cut:
                runner.copy_state(slots[i], snaps[i])
            last[cut] = forward([seqs[i] for i in cut], [slots[i] for i in cut],
                                [seqs[i].extend_part(len(prompts[i])) for i in cut])
        held = slots + [s for s in snaps if s >= 0]
        runs.append((last, runner.state_pool.conv_buffer[:, held].clone(),
                     runner.state_pool.recurrent_buffer[:, held].clone()))
        for s in held:
            runner.state_pool.free(s)
    for name, want, got in zip(("logits", "conv states", "recurrent states"), *runs):
        err = float((want - got).abs().max())
        assert err <= 1e-5 * max(1.0, float(want.abs().max())), f"snapshot forward {name}: max |difference| {err:.3g}"
    assert float(runs[0][2][:, 3:].abs().max()) > 0  # the snapshots hold states


if __name__ == "__main__":
    _check()
