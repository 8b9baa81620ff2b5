"""The decode step's projections alone, each way it could run, beside the memory roofline (issue 44).

``python -m epdserve.bench.decode_gemms --model-path DIR --batch-sizes 1 32 128 [--output-json F]`` (the fused
gate_up candidates alone: ``--projections gate_up --batch-sizes 1 32 64``; the split-K parts of issue 44:
``--projections o down --batch-sizes 2 8 32 64 128``)

Why: the fifth session's kernel table (docs/performance.md) found the small projections reading their weights at
1.3-1.7 TB/s (qkv, o: cuBLAS picks few, wide tiles for an ``[M, K] x [K, N]`` with M of 1 to 128 and N of 2-3k)
and ``down`` split over K with a separate reduce kernel, against 3.7-4.2 TB/s for gate_up and lm_head. This
measures, per projection of the checkpoint's language model and per batch size M, what each candidate reaches:

- ``linear``: ``F.linear`` as the model runs it (cuBLAS through torch's default BLAS handle);
- ``linear_lt``: the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``mv`` (M = 1): ``torch.mv(W, x)``, cuBLAS's GEMV;
- ``triton/BN/BK/W``: :func:`skinny_gemm`, a Triton kernel that gives each program ``BN`` output columns and the
  whole K (no split-K, no reduce kernel), so the small projections spread over every SM; on Hopper also
  ``triton_pdl/BN/BK/W``, the same launched with programmatic dependent launch: in the graph's chain of one call
  per layer, each call starts, and loads its first weight tile, while the one before it finishes (what a chain of
  such kernels in the decode step would gain; ``gate_up_silu`` always launches so on Hopper);
- for ``gate_up`` also ``silu_mul(linear)`` (the model's two kernels: the projection, then flashinfer's
  ``silu_and_mul``; named ``torch_silu_mul(linear)`` where flashinfer is not installed and torch's float32
  ``silu(g) * u`` stands in; the ratio column of the next ones is against it) and, for M <= 64,
  ``gate_up_silu/BN/BK/W/S`` for each of :data:`epdserve.models.gate_up_silu.CONFIGS`: both in one kernel, each
  program's gate and up columns accumulated side by side and ``silu(gate) * up`` written directly (one kernel and
  the ``[M, 2I]`` round trip fewer per layer). Their check is against the float32 ``silu(g) * u``;
- for ``qkv``, ``o`` and ``down`` at M of 2 to 128, ``parts/BM/BN/BK/KS/W/S[/pP]`` for
  :func:`epdserve.models.parts_gemm.config_for`'s pick and each of its ``CONFIGS`` whose K slice fits K:
  :func:`~epdserve.models.parts_gemm.gemm_parts`, the split-K float32 parts (their sum is checked, their time
  is the GEMM's alone: the sum is the next norm's). For ``o`` and ``down`` also the norm after them, where the parts
  replace both cuBLAS's reduce and flashinfer's norm: ``linear+norm`` (``F.linear`` then flashinfer's
  ``fused_add_rmsnorm``, the model's path; not run where flashinfer is not installed) against
  ``parts+norm/...`` (``gemm_parts`` then :func:`epdserve.models.decode_gemv.norm_parts` with the new residual
  out), both checked against the float32 RMSNorm of ``round(x @ W.T) + residual``.

Fusing SiLU-and-mul into ``down``'s loads instead (the skinny GEMM reading gate_up's output) measured 10x slower
than the two kernels and was removed.

Each candidate runs inside one CUDA graph over ``num_hidden_layers`` distinct weight tensors, one call per layer as
a decode step makes them, so the weights stream from HBM rather than from the 50 MB L2 (one 8 MB weight read again
and again would sit in it). Reported per call: microseconds, TB/s of weight bytes, and the ratio to ``linear``
(to ``silu_mul(linear)`` for gate_up's fused candidates, to ``linear+norm`` for the norm pairs; none where that
was not run). Each candidate's output is checked against a float32 ``x @ W.T`` (or its ``silu(g) * u``, or the
norm) first (relative error in bf16 rounding's range); a candidate that fails the check is reported and not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from epdserve.bench.step import copy_bandwidth, graph_us_per_call
from epdserve.device import supports_pdl
from epdserve.models import decode_gemv, parts_gemm
from epdserve.models import gate_up_silu as fused_mlp

# (BLOCK_N, BLOCK_K, num_warps) of the Triton candidate: narrow column blocks spread a 2k-column projection over
# 64-128 programs; K blocks of 256-512 bf16 are 16-byte loads for every thread of 4-8 warps.
TRITON_CONFIGS = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8), (64, 128, 4)]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_gemm_kernel(x, w, y, M, N, K, x_stride, w_stride, y_stride,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        # One program: BN output columns for every one of the M (<= BM) rows, the whole K in BK steps. The first K
        # step's weight tile is loaded before the PDL wait (weights are never written; x is the previous kernel's).
        n0 = tl.program_id(0) * BN
        rows = tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        b = tl.load(w + cols[:, None] * w_stride + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(x + rows[:, None] * x_stride + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        acc = tl.dot(a, tl.trans(b), tl.full((BM, BN), 0.0, tl.float32))
        for k0 in range(BK, K, BK):
            kk = k0 + ks
            in_x = (rows[:, None] < M) & (kk[None, :] < K)
            a = tl.load(x + rows[:, None] * x_stride + kk[None, :], mask=in_x, other=0.0)
            b = tl.load(w + cols[:, None] * w_stride + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K),
                        other=0.0)
            acc += tl.dot(a, tl.trans(b))
        tl.store(y + rows[:, None] * y_stride + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return skinny_gemm_kernel


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256,
                num_warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """``x @ w.T`` for a skinny ``x``: ``x`` ``[M, K]`` and ``w`` ``[N, K]`` (rows contiguous, one dtype; bf16 or
    fp16 on CUDA, any float under ``TRITON_INTERPRET=1``), M at most 128. Returns ``[M, N]`` in ``x``'s dtype,
    accumulated in float32. One program per ``block_n`` output columns, each over the whole K. With ``pdl`` (a
    Hopper GPU: :func:`epdserve.device.supports_pdl`) it launches with programmatic dependent launch, its first
    weight tile loaded before it waits for the previous kernel.

    Raises:
        ValueError: M over 128, mismatched K or dtypes, or rows that are not contiguous.
    """
    M, K = x.shape
    N = w.shape[0]
    if M > 128 or w.shape[1] != K or x.dtype != w.dtype or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny_gemm needs x [M <= 128, K] and w [N, K] of one dtype with contiguous rows; got "
                         f"x {list(x.shape)} {x.dtype}, w {list(w.shape)} {w.dtype}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm = max(16, 1 << (M - 1).bit_length())  # tl.dot's smallest tile is 16
    _kernel()[(-(-N // block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=block_n,
                                 BK=block_k, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    return y


@dataclass
class Row:
    """One (projection, batch size, candidate) measurement."""

    projection: str
    n: int
    k: int
    m: int
    candidate: str
    us_per_call: float | None
    tb_per_s: float | None
    vs_linear: float | None
    rel_error: float
    note: str = ""


def projections(config: dict) -> dict[str, tuple[int, int, int]]:
    """``name -> (N, K, copies)`` of the language model's decode projections, from a checkpoint's ``config.json``
    (``text_config`` when nested): qkv, o, gate_up, down with one weight per layer, lm_head once."""
    c = config.get("text_config", config)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or hidden // hq
    return {"qkv": ((hq + 2 * hkv) * d, hidden, layers), "o": (hidden, hq * d, layers),
            "gate_up": (2 * inter, hidden, layers), "down": (hidden, inter, layers),
            "lm_head": (c["vocab_size"], hidden, 1)}


@functools.cache
def _flashinfer_silu_and_mul():
    """flashinfer's ``silu_and_mul`` (what the model runs), or None where flashinfer is not installed."""
    try:
        from flashinfer.activation import silu_and_mul
    except ImportError:
        return None
    return silu_and_mul


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` in float32, rounded once to ``x``'s dtype: flashinfer's arithmetic in torch."""
    g, u = x.chunk(2, dim=-1)
    return (F.silu(g.float()) * u.float()).to(x.dtype)


def _fused_gate_up_candidates(m: int) -> dict:
    """For ``gate_up``: the model's two kernels (the first: the ratio column's base), then the fused kernel's
    configurations where it applies (M <= 64)."""
    silu_mul = _flashinfer_silu_and_mul()
    if silu_mul is None:
        out = {"torch_silu_mul(linear)": lambda x, w: torch_silu_and_mul(F.linear(x, w))}
    else:
        out = {"silu_mul(linear)": lambda x, w: silu_mul(F.linear(x, w))}
    if m <= fused_mlp.MAX_M:
        for cfg in fused_mlp.CONFIGS:
            out["gate_up_silu/" + "/".join(map(str, cfg))] = lambda x, w, cfg=cfg: fused_mlp.gate_up_silu(x, w, *cfg)
    return out


def _candidates(m: int) -> dict:
    # linear_lt is the same call: the BLAS library is switched around it (_blas)
    out = {"linear": F.linear, "linear_lt": F.linear}
    if m == 1:
        out["mv"] = lambda x, w: torch.mv(w, x[0])[None]
    for bn, bk, nw in TRITON_CONFIGS:
        out[f"triton/{bn}/{bk}/{nw}"] = lambda x, w, bn=bn, bk=bk, nw=nw: skinny_gemm(x, w, bn, bk, nw)
    if supports_pdl(torch.device("cuda")):
        for bn, bk, nw in TRITON_CONFIGS:
            out[f"triton_pdl/{bn}/{bk}/{nw}"] = lambda x, w, bn=bn, bk=bk, nw=nw: skinny_gemm(x, w, bn, bk, nw, True)
    return out


@contextlib.contextmanager
def _blas(lt: bool):
    """cuBLASLt as torch's BLAS library inside (``lt``), the default otherwise; restored after."""
    before = torch.backends.cuda.preferred_blas_library()
    if lt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _time(fn, x: torch.Tensor, weights: list[torch.Tensor], lt: bool, reps: int = 20) -> float:
    """Median microseconds per call of ``fn(x, w)`` over ``weights``, replayed from one CUDA graph."""
    with _blas(lt):
        return graph_us_per_call([functools.partial(fn, x, w) for w in weights], reps)


@dataclass
class Group:
    """Candidates checked against one float32 reference (``view`` maps a candidate's output to it); the ratio column
    is against ``base``'s time. ``restore`` puts back what a candidate updates in place (a residual); ``skipped``:
    candidate -> why it is not run."""

    cands: dict
    ref: torch.Tensor
    base: str
    view: Callable = lambda out: out
    restore: Callable = lambda: None
    skipped: dict = field(default_factory=dict)


def parts_candidates(m: int, n: int, k: int) -> dict:
    """``parts/<config>`` -> ``fn(x, w)`` for :func:`parts_gemm.config_for`'s pick and each of ``CONFIGS`` whose K
    slice is at most ``k`` (raised to M's row tile), where M is in ``MIN_M..MAX_M``; empty otherwise."""
    if not parts_gemm.MIN_M <= m <= parts_gemm.MAX_M:
        return {}
    cfgs = [parts_gemm.config_for(m, n, k)] + [c.with_rows(m) for c in parts_gemm.CONFIGS if c.k_split <= k]
    return {"parts/" + c.name: functools.partial(parts_gemm.gemm_parts, config=c) for c in cfgs}


@functools.cache
def _flashinfer_fused_add_rmsnorm():
    """flashinfer's ``fused_add_rmsnorm`` (what the model runs after o and down), or None without flashinfer."""
    try:
        from flashinfer.norm import fused_add_rmsnorm
    except ImportError:
        return None
    return fused_add_rmsnorm


EPS = 1e-6


def norm_group(m: int, k: int, want: torch.Tensor) -> Group:
    """The add + RMSNorm after ``o`` or ``down``: ``linear+norm`` (the model's path, flashinfer) and
    ``parts+norm/<config>`` for each of :func:`parts_candidates`, checked against the float32 RMSNorm of
    ``round(want) + residual`` (``want``: the float32 product ``[M, N]``; the residual and norm weight random)."""
    dtype, dev = torch.bfloat16, want.device
    residual = torch.randn(m, want.shape[1], device=dev).to(dtype)
    gamma = (1 + 0.1 * torch.randn(want.shape[1], device=dev)).to(dtype)
    saved = residual.clone()
    s = want.to(dtype).float() + residual.float()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
    cands, skipped = {}, {}
    add_rmsnorm = _flashinfer_fused_add_rmsnorm()
    if add_rmsnorm is None:
        skipped["linear+norm"] = "not run: flashinfer not installed"
    else:
        def linear_norm(x, w):
            y = F.linear(x, w)
            add_rmsnorm(y, residual, gamma, EPS)  # in place: y normed, residual updated
            return y
        cands["linear+norm"] = linear_norm
    for name, fn in parts_candidates(m, want.shape[1], k).items():
        cands["parts+norm/" + name.split("/", 1)[1]] = (
            lambda x, w, fn=fn: decode_gemv.norm_parts(fn(x, w), residual, gamma, EPS, residual_out=True)[0])
    return Group(cands, ref, "linear+norm", restore=lambda: residual.copy_(saved), skipped=skipped)


def _groups(name: str, m: int, x: torch.Tensor, w: torch.Tensor) -> list[Group]:
    want = x.float() @ w.float().T
    plain = {**_candidates(m), **(parts_candidates(m, w.shape[0], x.shape[1]) if name in ("qkv", "o", "down") else {})}
    out = [Group(plain, want, "linear", view=lambda out: out.sum(0) if out.dim() == 3 else out)]
    if name == "gate_up":  # its output feeds SiLU-and-mul: the fused candidates return that
        fused = _fused_gate_up_candidates(m)
        g, u = want.chunk(2, dim=-1)
        out.append(Group(fused, F.silu(g) * u, next(iter(fused))))
    if name in ("o", "down") and parts_gemm.MIN_M <= m <= parts_gemm.MAX_M:
        out.append(norm_group(m, x.shape[1], want))
    return out


def check(cand: str, fn, group: Group, x: torch.Tensor, w: torch.Tensor) -> tuple[float, str]:
    """``(relative error, note)`` of one call against the group's reference; the note is empty where it is right."""
    try:
        with _blas(cand == "linear_lt"):
            got = group.view(fn(x, w)).float()
    except Exception as e:  # e.g. a Triton block too large for shared memory at this M
        return float("nan"), f"failed: {type(e).__name__}"
    finally:
        group.restore()
    err = float((got - group.ref).abs().max() / group.ref.abs().max())
    # bf16 output rounding is 4e-3 of the value; a wrong kernel is off by O(1)
    return err, ("wrong result: not timed" if err > 2e-2 else "")


def measure(name: str, n: int, k: int, copies: int, m: int, device: torch.device) -> list[Row]:
    """Every candidate for one projection and batch size (see the module docstring)."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    rows = []
    for group in _groups(name, m, x, weights[0]):
        rows += [Row(name, n, k, m, c, None, None, None, float("nan"), note) for c, note in group.skipped.items()]
        base = None
        for cand, fn in group.cands.items():
            err, note = check(cand, fn, group, x, weights[0])
            if note:
                rows.append(Row(name, n, k, m, cand, None, None, None, err, note))
                continue
            us = _time(fn, x, weights, lt=cand == "linear_lt")
            group.restore()
            base = us if cand == group.base else base
            rows.append(Row(name, n, k, m, cand, round(us, 2), round(n * k * 2 / us / 1e6, 3),
                            round(us / base, 3) if base else None, err))
    del weights
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="checkpoint directory (only config.json is read)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--projections", nargs="+", default=None, help="a subset of qkv o gate_up down lm_head")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    with open(f"{args.model_path}/config.json") as f:
        shapes = projections(json.load(f))
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    rows = []
    for name, (n, k, copies) in shapes.items():
        if args.projections and name not in args.projections:
            continue
        for m in args.batch_sizes:
            for row in measure(name, n, k, copies, m, device):
                rows.append(row)
                print(f"{name:8s} N={n:6d} K={k:6d} M={m:4d} {row.candidate:34s} "
                      + (f"{row.us_per_call:8.2f} us {row.tb_per_s:5.2f} TB/s "
                         + (f"{row.vs_linear:5.2f}x" if row.vs_linear is not None else "  n/a")
                         if row.us_per_call is not None else row.note) + f"  err {row.rel_error:.1e}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "copy_bandwidth_tbps": bw / 1e12,
                       "model_path": args.model_path, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
