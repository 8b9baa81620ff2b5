"""The routed experts' implementations (epdserve.models.moe_experts) against the reference loop: the grouped-GEMM
path equals it bit for bit in float32 on the CPU (same GEMM per expert, same summation order), the gathered-bmm
path within float rounding; both trace into one graph with no data-dependent step (what a CUDA graph capture
needs), which the loop cannot."""

from __future__ import annotations

import pytest
import torch

from epdserve.models import moe_decode as mod  # noqa: F401 (the interpreter fixture rebuilds mod._kernel)
from epdserve.models.moe_experts import METHODS, default_method, experts_loop, run_experts
from epdserve.models.qwen3_vl_moe_lm import route, route_torch

E, HIDDEN, INTER, TOP_K = 16, 64, 24, 4


def _case(tokens: int, dtype=torch.float32, seed: int = 0):
    """Random expert weights, activations and their routing (``route``, so ids are distinct per row)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(E, HIDDEN, INTER, generator=g) * 0.2
    x = torch.randn(tokens, HIDDEN, generator=g)
    weights, experts = route(x, torch.randn(E, HIDDEN, generator=g), TOP_K)
    return [t.to(dtype) for t in (x, gate_up, down, weights)] + [experts]


@pytest.mark.parametrize("tokens", [1, 3, 64, 301])
def test_grouped_equals_the_loop_bitwise_and_gathered_closely(tokens):
    x, gate_up, down, weights, experts = _case(tokens, seed=tokens)
    want = experts_loop(x, gate_up, down, weights, experts)
    assert want.abs().max() > 0.1
    assert torch.equal(run_experts(x, gate_up, down, weights, experts, "grouped"), want)
    torch.testing.assert_close(run_experts(x, gate_up, down, weights, experts, "gathered"), want,
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_paths_agree_with_the_loop():
    x, gate_up, down, weights, experts = _case(40, torch.bfloat16)
    want = experts_loop(x, gate_up, down, weights, experts)
    for method in ("grouped", "gathered"):
        got = run_experts(x, gate_up, down, weights, experts, method)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("method,dtype", [("grouped", torch.bfloat16), ("gathered", torch.float32)])
def test_capturable_paths_trace_whole_with_no_host_sync(method, dtype):
    """``torch.compile(fullgraph=True)`` fails on any data-dependent step (``.tolist()``, ``unique``, ``nonzero``):
    the ops a CUDA graph cannot capture. The graph-capturable paths trace whole; the loop does not.
    (grouped_mm's shape check accepts only bf16 while tracing, as on CUDA.)"""
    args = _case(9, dtype)
    compiled = torch.compile(lambda *a: run_experts(*a, method=method), backend="eager", fullgraph=True)
    assert torch.equal(compiled(*args), run_experts(*args, method=method))
    loop = torch.compile(experts_loop, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="data-dependent|Could not guard|unique|tolist"):
        loop(*args)


def test_default_method_and_unknown_method():
    assert default_method(torch.zeros(1, 4), 8) == "loop"
    assert set(METHODS) == {"loop", "grouped", "gathered", "fused"}
    with pytest.raises(ValueError, match="unknown experts method"):
        run_experts(*_case(2), method="bogus")


def test_every_method_serves_the_tiny_moe_lm_alike(interpreter, tiny_qwen3_vl_moe_path):
    """The tiny Qwen3-VL-MoE through epdserve's runner: a prefill and greedy decode steps give the same logits with
    the experts forced onto each method as on the loop (bitwise for grouped; the fused kernels on Triton's
    interpreter)."""
    from test_model_runtime import Pages
    from test_qwen3_vl_model import Seq3, greedy

    from epdserve.engine.model_runner import ModelRunner
    from epdserve.models.qwen3_vl_moe_lm import Experts

    ids = torch.randint(0, 500, (14,), generator=torch.Generator().manual_seed(3))
    results = {}
    for method in METHODS:
        runner = ModelRunner(tiny_qwen3_vl_moe_path, device=torch.device("cpu"), dtype=torch.float32,
                             num_pages=16, page_size=16, attention_backend="sdpa")
        experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
        assert len(experts) == runner.config.num_layers
        for m in experts:
            m.method = method
        results[method] = greedy(runner, Seq3(ids, [], Pages(16, seed=1).take(2), 16), 6)
    first, tokens = results["loop"]
    assert torch.equal(results["grouped"][0], first) and results["grouped"][1] == tokens
    for method in ("gathered", "fused"):
        torch.testing.assert_close(results[method][0], first, rtol=1e-5, atol=1e-5)
        assert results[method][1] == tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["grouped", "gathered", "fused"])
def test_capturable_paths_replay_in_a_cuda_graph(method):
    """On the GPU: the method captured in a CUDA graph, replayed on new routing written into its static inputs,
    equals its eager call and stays within bf16 rounding of the loop."""
    x, gate_up, down, weights, experts = (t.cuda() for t in _case(24, torch.bfloat16))
    static = [x.clone(), weights.clone(), experts.clone()]
    run_experts(static[0], gate_up, down, static[1], static[2], method)  # warm-up (workspaces, kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_experts(static[0], gate_up, down, static[1], static[2], method)
    x2, _, _, w2, e2 = (t.cuda() for t in _case(24, torch.bfloat16, seed=7))
    for dst, src in zip(static, (x2, w2, e2)):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, run_experts(x2, gate_up, down, w2, e2, method), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), experts_loop(x2, gate_up, down, w2, e2).float(), rtol=2e-2, atol=2e-2)


def _gamma(n: int) -> float:
    """The float32 bound on n rounded additions or products, relative to the sum of magnitudes (Higham's gamma_n)."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_fused_kernels_match_float64_on_the_interpreter(interpreter, tokens):
    """The two Triton kernels (epdserve.models.moe_decode) under Triton's CPU interpreter, float32, against the same
    arithmetic in float64, within float32's rounding bound propagated through SiLU, the down product and the
    weighted sum of the k slots (and the loop agrees with them within the same bound)."""
    x, gate_up, down, weights, experts = _case(tokens, seed=11 + tokens)
    got = run_experts(x, gate_up, down, weights, experts, "fused").double()
    silu = torch.nn.functional.silu
    want = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
    bound = torch.zeros_like(want)
    for t in range(tokens):
        xt = x[t].double()
        for j in range(TOP_K):
            e, w = int(experts[t, j]), float(weights[t, j])
            gu, d = gate_up[e].double(), down[e].double()
            h, mag = gu @ xt, gu.abs() @ xt.abs()
            g, u, dg, du = h[:INTER], h[INTER:], _gamma(HIDDEN) * mag[:INTER], _gamma(HIDDEN) * mag[INTER:]
            act = silu(g) * u
            dact = 1.1 * dg * (u.abs() + du) + silu(g).abs() * du + 4 * 2.0**-24 * act.abs()
            y = d @ act
            dy = _gamma(INTER) * (d.abs() @ act.abs()) + d.abs() @ dact
            want[t] += w * y
            bound[t] += abs(w) * (dy + _gamma(TOP_K + 1) * y.abs())
    assert got.shape == want.shape
    assert bool(((got - want).abs() <= bound).all())
    loop = experts_loop(x, gate_up, down, weights, experts).double()
    assert bool(((loop - want).abs() <= bound).all())
    # the bound still tells a wrong kernel apart: dropping one slot moves outputs by ~1e-1 of their size
    assert float(bound.max()) < 1e-3 * float(want.abs().max())


def test_down_kernel_tile_stays_within_its_register_budget():
    # the 30B-A3B: 8 slots of 768 (padded to 1024), two columns a program
    assert mod.down_launch(8, 768) == dict(KP=8, BK=1024, BN=2, num_warps=4)
    for k, inter in ((8, 768), (8, 1536), (10, 512), (16, 4096), (2, 48), (1, 16)):
        launch = mod.down_launch(k, inter)
        rows = launch["KP"] * launch["BN"]
        assert launch["KP"] >= k and launch["BK"] >= inter and launch["BN"] >= 1
        assert rows * launch["BK"] <= max(mod.DOWN_TILE, launch["KP"] * launch["BK"])  # one column's tile may exceed
        assert rows * launch["BK"] // (32 * launch["num_warps"]) <= 128  # weight elements a thread


def test_fused_method_checks_its_inputs():
    x, gate_up, down, weights, experts = _case(2)
    with pytest.raises(ValueError, match="fused experts need"):
        run_experts(x, gate_up, down[:, :, :-1], weights, experts, "fused")
    with pytest.raises(ValueError, match="one dtype"):
        run_experts(x.double(), gate_up, down, weights, experts, "fused")


def test_the_experts_bench_reads_the_checkpoints_expert_shapes(tiny_qwen3_vl_moe_path, tiny_model_path):
    from epdserve.bench.moe_experts import expert_shapes

    # the tiny checkpoint's ratios (make-tiny-model --arch qwen3-vl-moe): 32 experts, top 2, hidden 128, width 48
    assert expert_shapes(tiny_qwen3_vl_moe_path) == (32, 2, 128, 48)
    with pytest.raises(ValueError, match="not an MoE checkpoint"):
        expert_shapes(tiny_model_path)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 16, 4), (5, 128, 8), (3, 60, 2)])
def test_fused_routing_matches_route_on_the_interpreter(interpreter, tokens, experts, top_k):
    """The routing kernel (softmax, top-k, renormalisation in one launch) against ``route``, float32: the same
    experts in the same order, weights within float32 rounding."""
    g = torch.Generator().manual_seed(tokens * experts)
    x, gate = torch.randn(tokens, 32, generator=g), torch.randn(experts, 32, generator=g)
    weights, ids = mod.route_fused(x, gate, top_k)
    want_w, want_ids = route(x, gate, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == x.dtype
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="top_k <= experts"):
        mod.route_fused(x, gate[:1], 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_routing_on_cuda_picks_the_same_experts():
    """bf16 on the GPU: the routing kernel picks route's experts wherever the k-th and (k+1)-th probabilities are
    apart (Triton's exp is not torch's: a near-tie may fall either way), with weights within bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = torch.randn(128, 2048, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    weights, ids = mod.route_fused(x, gate, 8)
    want_w, want_ids = route_torch(x, gate, 8)
    probs = torch.softmax(torch.nn.functional.linear(x, gate), dim=-1, dtype=torch.float32).topk(9).values
    apart = (probs[:, 7] - probs[:, 8]) > 1e-5
    assert apart.sum() > 32
    # the same experts with the same weights; two near-equal probabilities inside the top k may come in either
    # order, which the weighted sum does not see
    ids, order = ids[apart].sort(dim=-1)
    want_ids, want_order = want_ids[apart].sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights[apart].gather(1, order).float(), want_w[apart].gather(1, want_order).float(),
                               rtol=1e-2, atol=1e-3)
