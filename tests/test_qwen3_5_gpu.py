"""Qwen3.5's hybrid LM on CUDA (skipped without one): the GPU kernels (:mod:`epdserve.models.deltanet_cuda`:
flash-linear-attention's varlen conv and chunked delta rule for extends, the slot-indexed conv update and fla's
continuous-batching recurrent kernel for decode; flashinfer's norms and attention in bf16) against the torch
reference that the CPU tests hold equal to transformers, and decode CUDA graphs against eager steps, on the
``small`` random checkpoint (the 9B's head shapes, so the kernels run at their real tile sizes).

The reference is that torch code (transformers' torch DeltaNet functions, SDPA attention, plain norms) run in
float32 on the GPU, with TF32 off: the same arithmetic as on the CPU, where tests/test_qwen3_5_model.py holds it
equal to transformers, in seconds instead of the CPU's ~40 s. The comparisons are teacher-forced on the reference's
tokens, so one near-tie cannot derail the rest. In float32 (SDPA attention: flashinfer's kernels are 16-bit only)
every step's logits must agree within a bound, and a differing argmax is allowed only where the reference's own
top-two margin is within twice the step's measured logit difference (a near-tie). In bf16 the whole CUDA path
(flashinfer's fused norms too) may differ from the float32 reference by no more than the CPU's plain bf16 torch
path does, within a factor of two."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_model_runtime import Pages, Seq, make_batch

from epdserve.engine.forward_batch import ForwardBatch
from epdserve.engine.model_runner import ModelRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# One pytest-xdist worker for the whole module (``--dist loadgroup``): its tests share the module's fixtures and
# flash-linear-attention's Triton kernels, which JIT-compile and autotune for ~2 minutes on an empty cache; spread
# over three workers (``--dist load``), each compiled them itself, side by side (119-127 s per test, 2026-11-29).
pytestmark = pytest.mark.xdist_group("qwen3_5_gpu")
PAGE = 16
# Prompt lengths: inside the conv window, across several 64-token delta-rule chunks, and long.
LENGTHS = (3, 150, 700)


@pytest.fixture(scope="module")
def small35(tmp_path_factory) -> str:
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("small-qwen3.5"), arch="qwen3.5", size="small"))


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, min(vocab, 1000), (n,), generator=gen).tolist() for n in LENGTHS]


class _Req:
    def __init__(self, runner: ModelRunner, ids: list[int], pages: Pages, steps: int):
        self.runner = runner
        self.seq = Seq(ids, [], pages.take(-(-(len(ids) + steps + 1) // PAGE)), PAGE)
        self.slot = runner.state_pool.alloc()

    def close(self):
        self.runner.state_pool.free(self.slot)


def _forward(runner: ModelRunner, reqs: list[_Req], parts: list[dict], is_decode: bool) -> torch.Tensor:
    b = make_batch(parts, is_decode)
    batch = ForwardBatch(b.is_decode, b.input_ids, b.positions, b.out_slots, b.q_lens, b.kv_lens, b.page_table,
                         state_slots=[r.slot for r in reqs])
    return runner.forward(batch).float().cpu()


def _teacher_forced(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None, steps: int):
    """Logits ``[steps + 1][B, vocab]`` (float32, host): the prompts prefilled in one batch, then ``steps`` decode
    steps fed ``forced``'s tokens (None: the runner's own greedy tokens). Returns (logits, tokens fed)."""
    pages = Pages(runner.num_pages)
    reqs = [_Req(runner, p, pages, steps) for p in prompts]
    try:
        out = [_forward(runner, reqs, [r.seq.extend_part(len(p)) for r, p in zip(reqs, prompts)], False)]
        fed = [[] for _ in prompts]
        for step in range(steps):
            toks = [f[step] for f in forced] if forced else out[-1].argmax(-1).tolist()
            for f, t in zip(fed, toks):
                f.append(t)
            out.append(_forward(runner, reqs, [r.seq.decode_part(t) for r, t in zip(reqs, toks)], True))
        return out, fed
    finally:
        for r in reqs:
            r.close()


STEPS = 24
KW = dict(num_pages=512, page_size=PAGE, num_state_slots=4)


@contextlib.contextmanager
def _torch_code_in_float32():
    """While open, a DeltaNet layer off the kernels runs transformers' torch functions on any device (on CUDA
    transformers would hand them to fla's kernels, the very code under test), and float32 matmuls and convolutions
    on CUDA run in float32 (cuDNN's default lets a convolution round its inputs to TF32's 10-bit mantissa)."""
    from epdserve.models import qwen3_5_deltanet

    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with pytest.MonkeyPatch.context() as mp:
            # _kernels("cpu") is the unwrapped torch code; nothing in it depends on the tensors' device.
            mp.setattr(qwen3_5_deltanet, "_ref", lambda device: qwen3_5_deltanet._kernels("cpu"))
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(scope="module")
def reference32(small35):
    """The float32 torch path's greedy run on the GPU (computed once): ``(prompts, logits, tokens fed)``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from epdserve.models.qwen3_5_deltanet import GatedDeltaNet

    ref = ModelRunner(small35, device=torch.device("cuda"), attention_backend="sdpa", dtype=torch.float32, **KW)
    # The runner turns the DeltaNet kernels on wherever fla imports; the reference is the torch code.
    ref.model.deltanet_kernels = False
    for m in ref.model.modules():
        if isinstance(m, GatedDeltaNet):
            m.use_kernels(False)
    assert not ref.model.fused_ops
    prompts = _prompts(ref.config.vocab_size)
    with _torch_code_in_float32():
        want, fed = _teacher_forced(ref, prompts, None, STEPS)
    return prompts, want, fed


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_equal_the_torch_reference_in_float32(small35, reference32):
    prompts, want, fed = reference32
    gpu = ModelRunner(small35, device=torch.device("cuda"), dtype=torch.float32, **KW)
    assert gpu.model.deltanet_kernels, "fla-core is not installed: pip install -e '.[hybrid-gpu]'"
    got, _ = _teacher_forced(gpu, prompts, fed, STEPS)
    # float32 kernels (fla's chunked delta rule runs its matmuls in TF32 at most) stay far below the logits' own
    # scale; a wrong state (slot, chunk carry, conv window) moves them by O(scale).
    err, scale, ties = _assert_close_steps(want, got)
    print(f"float32: max |logit difference| {err:.3g} (logit scale {scale:.3g}); argmax differs at {ties} near-ties")


def _assert_close_steps(want: list[torch.Tensor], got: list[torch.Tensor], what: str = "") -> tuple[float, float, int]:
    """Each step's logits ``[B, vocab]`` of ``got`` within 2 % of ``want``'s logit scale, and a different argmax
    only where ``want``'s top-two margin is within twice that step's difference (a near-tie). Returns (largest
    difference, scale, near-ties)."""
    scale = max(float(w.abs().max()) for w in want)
    worst, ties = 0.0, 0
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        err = float((w - g).abs().max())
        worst = max(worst, err)
        assert err <= 0.02 * scale, f"{what}step {step}: max |logit difference| {err:.4g} (logit scale {scale:.3g})"
        top2 = w.topk(2, dim=-1).values
        for row in (w.argmax(-1) != g.argmax(-1)).nonzero().flatten().tolist():
            margin = float(top2[row, 0] - top2[row, 1])
            assert margin <= 2 * err, f"{what}step {step}, prompt {row}: argmax differs at margin {margin:.4g}"
            ties += 1
    return worst, scale, ties


@pytest.mark.gpu
@needs_cuda
def test_bf16_decode_graphs_equal_eager_steps(small35):
    steps = 32
    kw = dict(device=torch.device("cuda"), dtype=torch.bfloat16, num_pages=512, page_size=PAGE, num_state_slots=8)
    eager = ModelRunner(small35, **kw)
    graphed = ModelRunner(small35, cuda_graph_max_bs=8, **kw)
    assert eager.graphs is None and graphed.graphs is not None
    prompts = _prompts(eager.config.vocab_size)
    for batch in (prompts[:1], prompts):
        # Teacher-forced on eager's greedy tokens: batch 3 replays the graph of 4, other GEMM shapes, and a
        # bf16 near-tie of the random checkpoint may round the other way there.
        want, fed = _teacher_forced(eager, batch, None, steps)
        got, _ = _teacher_forced(graphed, batch, fed, steps)
        err, scale, ties = _assert_close_steps(want, got, f"batch {len(batch)}, ")
        print(f"bf16, batch {len(batch)}: {steps} decode steps of graph replays against eager steps: max |logit "
              f"difference| {err:.3g} (scale {scale:.3g}), argmax differs at {ties} near-ties (prompts of "
              f"{', '.join(map(str, LENGTHS))} tokens; graphs of 1, 2, 4, 8: batch 3 is padded to 4)")


@pytest.mark.gpu
@needs_cuda
def test_bf16_cuda_path_is_within_bf16_rounding_of_float32(small35, reference32):
    # The two shorter prompts (one inside the conv window, one over three delta-rule chunks): the CPU's bf16
    # matmuls are slow, and the 700-token prompt adds no path the float32 test has not covered.
    steps, n = 6, 2
    prompts, want, fed = reference32
    prompts, want, fed = prompts[:n], [w[:n] for w in want[:steps + 1]], [f[:steps] for f in fed[:n]]
    cpu = ModelRunner(small35, device=torch.device("cpu"), attention_backend="sdpa", dtype=torch.bfloat16, **KW)
    plain, _ = _teacher_forced(cpu, prompts, fed, steps)
    gpu = ModelRunner(small35, device=torch.device("cuda"), dtype=torch.bfloat16, **KW)
    assert gpu.model.fused_ops and gpu.model.deltanet_kernels
    got, _ = _teacher_forced(gpu, prompts, fed, steps)
    err_plain = max(float((w - p).abs().max()) for w, p in zip(want, plain))
    err_gpu = max(float((w - g).abs().max()) for w, g in zip(want, got))
    print(f"max |logit - float32 reference|: CPU bf16 torch path {err_plain:.4g}, CUDA bf16 kernels {err_gpu:.4g}")
    assert err_gpu <= 2 * err_plain, f"CUDA bf16 error {err_gpu:.4g} > 2x the CPU bf16 path's {err_plain:.4g}"


@pytest.mark.gpu
@needs_cuda
def test_bf16_prefill_graphs_equal_eager_extends(small35):
    """One request's extends replayed from prefill CUDA graphs (its rows padded up to the captured size, the
    DeltaNet layers on fla's fixed-length kernels with the padding's gates zeroed) against the eager varlen
    kernels: each prompt prefilled in two extends (a fresh one cut at a page boundary, as the prefill server cuts
    a hybrid prompt for its state snapshot, then a continued one), then decode steps teacher-forced on the eager
    run's greedy tokens (free-running, one bf16 near-tie of the random checkpoint sends the two runs down different
    token paths, as it did on an H200). Every step's logits must agree to well within the model's logit scale, and
    the greedy tokens must be equal unless eager's own top-two margin is within twice that step's difference (a
    near-tie); a wrong final state (padding leaking into it, a wrong conv window or slot) moves the logits by
    O(scale)."""
    steps = 8
    kw = dict(device=torch.device("cuda"), dtype=torch.bfloat16, num_pages=512, page_size=PAGE, num_state_slots=4)
    eager = ModelRunner(small35, **kw)
    graphed = ModelRunner(small35, prefill_graph_max_tokens=1024, **kw)
    assert eager.prefill_graphs is None and graphed.prefill_graphs is not None
    for ids in _prompts(eager.config.vocab_size):
        cut = max(1, (len(ids) - 1) // PAGE * PAGE)
        runs, fed = [], []
        for runner in (eager, graphed):
            req = _Req(runner, ids, Pages(runner.num_pages), steps)
            try:
                logits = [_forward(runner, [req], [req.seq.extend_part(n)], False) for n in (cut, len(ids))
                          if n > req.seq.cached]
                for step in range(steps):
                    if runner is eager:
                        fed.append(int(logits[-1].argmax()))
                    logits.append(_forward(runner, [req], [req.seq.decode_part(fed[step])], True))
            finally:
                req.close()
            runs.append(logits)
        err, scale, ties = _assert_close_steps(*runs, f"{len(ids)}-token prompt, ")
        print(f"{len(ids)} tokens: max |graph - eager logit| {err:.4g} (logit scale {scale:.3g}) over "
              f"{len(runs[0])} forwards; greedy differs at {ties} near-ties")


@pytest.mark.gpu
@needs_cuda
def test_snapshots_taken_inside_one_extend_equal_two_extends_in_float32(small35):
    """The prefill server's state snapshots at each prompt's last page boundary, taken inside one eager varlen
    extend (``ForwardBatch.state_snapshots``: fla's chunked rule over the prompts split at their cuts, then over
    the tails again from the cut states) against what two extends did (every prompt up to its cut, the states
    copied to the snapshot slots, then the tails), in float32 so that rounding cannot flip a near-tie: the last
    tokens' logits and every request's and snapshot's states right after the prefill, then decode steps
    teacher-forced on the two-extend run's greedy tokens. A wrong split, tail or window moves them by O(scale)."""
    steps = 6
    runner = ModelRunner(small35, device=torch.device("cuda"), dtype=torch.float32, num_pages=512, page_size=PAGE,
                         num_state_slots=8)
    assert runner.model.deltanet_kernels, "fla-core is not installed: pip install -e '.[hybrid-gpu]'"
    prompts = _prompts(runner.config.vocab_size)
    cuts = [(len(ids) - 1) // PAGE * PAGE for ids in prompts]  # 0 for the 3-token prompt: it has no snapshot
    runs, fed = [], None
    for one_forward in (False, True):
        pages = Pages(runner.num_pages)  # one allocator: the requests' pages must not overlap
        reqs = [_Req(runner, ids, pages, steps) for ids in prompts]
        snaps = [runner.state_pool.alloc() if c else -1 for c in cuts]
        try:
            if one_forward:
                b = make_batch([r.seq.extend_part(len(ids)) for r, ids in zip(reqs, prompts)], False)
                batch = ForwardBatch(b.is_decode, b.input_ids, b.positions, b.out_slots, b.q_lens, b.kv_lens,
                                     b.page_table, state_slots=[r.slot for r in reqs],
                                     state_snapshots=[(i, c, s) for i, (c, s) in enumerate(zip(cuts, snaps)) if c])
                last = runner.forward(batch).float().cpu()
            else:
                first = _forward(runner, reqs, [r.seq.extend_part(c or len(ids))
                                                for r, c, ids in zip(reqs, cuts, prompts)], False)
                cut = [i for i, c in enumerate(cuts) if c]
                for i in cut:
                    runner.copy_state(reqs[i].slot, snaps[i])
                tails = _forward(runner, [reqs[i] for i in cut], [reqs[i].seq.extend_part(len(prompts[i]))
                                                                  for i in cut], False)
                last = first.clone()
                last[cut] = tails
            slots = [r.slot for r in reqs] + [s for s in snaps if s >= 0]
            states = [runner.state_pool.conv_buffer[:, slots].float().cpu(),
                      runner.state_pool.recurrent_buffer[:, slots].float().cpu()]
            logits = [last]
            if fed is None:
                fed = [last.argmax(-1)]
            for step in range(steps):
                logits.append(_forward(runner, reqs, [r.seq.decode_part(int(x)) for r, x in zip(reqs, fed[step])],
                                       True))
                if len(fed) <= step + 1:
                    fed.append(logits[-1].argmax(-1))
        finally:
            for r in reqs:
                r.close()
            for s in snaps:
                if s >= 0:
                    runner.state_pool.free(s)
        runs.append((logits, states))
    (want, want_states), (got, got_states) = runs
    scale = max(float(w.abs().max()) for w in want)
    errs = [float((w - g).abs().max()) for w, g in zip(want, got)]
    state_errs = [float((w - g).abs().max()) / max(1e-6, float(w.abs().max()))
                  for w, g in zip(want_states, got_states)]
    print(f"one extend vs two (float32): max |logit difference| per step {[round(e, 5) for e in errs]} (scale "
          f"{scale:.3g}); relative state differences after the prefill: conv {state_errs[0]:.3g}, recurrent "
          f"{state_errs[1]:.3g}")
    assert max(state_errs) <= 0.01, f"states differ by {state_errs} of their scale"
    assert max(errs) <= 0.02 * scale, f"logits differ by {errs} (scale {scale:.3g})"
