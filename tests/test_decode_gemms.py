"""The decode-GEMM bench's Triton candidate (benchmarks/decode_gemms.py: ``x @ w.T`` for a skinny ``x``, one program
per column block over the whole K) against a float32 matmul, on the CPU through Triton's interpreter: ragged M, N
and K (masks at every edge), M of one and above one tile. Its split-K parts candidates (``parts/``, ``parts+norm/``):
which configs it lists, and that they pass its check (timing needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from epdserve.bench import decode_gemms as mod



@pytest.mark.parametrize("M,N,K,block_n,block_k", [(1, 40, 96, 16, 32), (5, 33, 70, 16, 32), (17, 64, 200, 32, 64)])
def test_skinny_gemm_equals_a_float32_matmul(interpreter, M, N, K, block_n, block_k):
    g = torch.Generator().manual_seed(M * N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    got = mod.skinny_gemm(x, w, block_n, block_k)
    want = x.double() @ w.double().T
    err = float((got.double() - want).abs().max())
    print(f"M={M} N={N} K={K} block {block_n}x{block_k}: max |error| {err:.2e}")
    assert got.shape == (M, N) and err < 1e-3 * float(want.abs().max())


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="skinny_gemm needs"):
        mod.skinny_gemm(torch.zeros(129, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="skinny_gemm needs"):
        mod.skinny_gemm(torch.zeros(2, 8), torch.zeros(4, 9))


def test_parts_candidates_are_the_configs_that_fit():
    """``parts/...`` at M of 2 to 128: config_for's pick, then each of CONFIGS whose K slice fits K (o's 2048 leaves
    out the 2816-wide down slices), raised to M's row tile; none at one row or past 128."""
    from epdserve.models import parts_gemm

    assert mod.parts_candidates(1, 2048, 2048) == {} and mod.parts_candidates(129, 2048, 2048) == {}
    o, down = mod.parts_candidates(32, 2048, 2048), mod.parts_candidates(32, 2048, 11008)
    pick = "parts/" + parts_gemm.config_for(32, 2048, 2048).name
    assert next(iter(o)) == pick and all(name.startswith("parts/") for name in o)
    assert set(down) >= {"parts/" + c.with_rows(32).name for c in parts_gemm.CONFIGS}
    assert len(o) < len(down) and "parts/32/64/128/2816/4/4" not in o
    assert all(name.split("/")[1] == "128" for name in mod.parts_candidates(128, 2048, 11008))


@pytest.fixture
def parts_interpreter(interpreter):
    """The interpreter for parts_gemm's and decode_gemv's kernels too (the ``interpreter`` fixture rebuilds the
    bench's own)."""
    from epdserve.models import decode_gemv, parts_gemm

    kernels = (parts_gemm._kernel, decode_gemv._kernel)
    for kernel in kernels:
        kernel.cache_clear()
    yield
    for kernel in kernels:
        kernel.cache_clear()


def test_parts_and_parts_norm_candidates_pass_the_bench_check(parts_interpreter):
    """On the CPU (no timing: that needs a CUDA graph) each ``parts/`` candidate's summed parts and each
    ``parts+norm/`` candidate's normed rows pass the bench's check; ``linear+norm`` is reported as not run without
    flashinfer, and a wrong candidate is caught."""
    M, N, K = 3, 48, 1100  # K: slices of 512 and 1024 (CONFIGS' o entries) with tails; N under one column block
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(torch.bfloat16)
    want = x.float() @ w.float().T
    plain = mod.Group(mod.parts_candidates(M, N, K), want, "linear", view=lambda out: out.sum(0))
    norm = mod.norm_group(M, K, want)
    assert len(plain.cands) == len(norm.cands) - ("linear+norm" in norm.cands) > 3
    for group in (plain, norm):
        for cand, fn in group.cands.items():
            if cand == "linear+norm":
                continue  # flashinfer: CUDA only
            err, note = mod.check(cand, fn, group, x, w)
            assert note == "" and err < 2e-2, (cand, err, note)
    if mod._flashinfer_fused_add_rmsnorm() is None:
        assert norm.skipped == {"linear+norm": "not run: flashinfer not installed"}
    first = next(iter(plain.cands.values()))
    err, note = mod.check("wrong", lambda x, w: first(x, w) * 0.9, plain, x, w)
    assert note == "wrong result: not timed"


def test_measure_reports_the_parts_rows(parts_interpreter, monkeypatch):
    """measure's rows for o at 3 rows on the CPU, the CUDA-graph timing replaced by a fixed time per candidate: the
    parts against ``linear``; the norm pair's ratio against ``linear+norm``, none where that was not run."""
    times = {"linear": 10.0}
    monkeypatch.setattr(mod, "_candidates", lambda m: {"linear": torch.nn.functional.linear})
    monkeypatch.setattr(mod, "_time", lambda fn, x, weights, lt: times.get(getattr(fn, "__name__", ""), 5.0))
    rows = {r.candidate: r for r in mod.measure("o", 48, 1100, 2, 3, torch.device("cpu"))}
    parts = [r for name, r in rows.items() if name.startswith("parts/")]
    norms = [r for name, r in rows.items() if name.startswith("parts+norm/")]
    assert rows["linear"].vs_linear == 1.0 and len(parts) == len(norms) > 3
    assert all(r.us_per_call == 5.0 and r.vs_linear == 0.5 and r.rel_error < 2e-2 for r in parts)
    if mod._flashinfer_fused_add_rmsnorm() is None:
        assert rows["linear+norm"].note.startswith("not run") and rows["linear+norm"].us_per_call is None
        assert all(r.us_per_call == 5.0 and r.vs_linear is None for r in norms)
