"""The routed experts of one MoE layer alone, each ``run_experts`` method, beside the bytes they must read (issue 50).

``python -m epdserve.bench.moe_experts --model-path DIR --batch-sizes 1 2 4 8 16 32 [--output-json F]``

Why: a decode step of Qwen3-VL-30B-A3B's shapes took ~170 us per layer at one row on an H200 against ~28 us of
bytes (docs/performance.md, fourteenth session); this separates the experts' share and compares the methods of
:mod:`epdserve.models.moe_experts` (``grouped``, ``gathered``, ``fused``) on the checkpoint's expert shapes
(its ``config.json`` only: experts, top-k, hidden and expert width; random bf16 weights here). Each method
runs inside one CUDA graph over ``--layers`` distinct layers' expert weights, one call per layer with routing drawn
by the model's own top-k of random router logits, so the weights come from HBM as in a decode step. Reported per
call: microseconds, the bytes of the experts the call's rows reach (each reached expert's gate_up and down once),
that over the call's time, and the time against ``grouped``. Each method's output is checked against the
float32 loop first; a method off by more than bf16 rounding is reported and not timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from epdserve.bench.step import copy_bandwidth, graph_us_per_call
from epdserve.models.config import ModelConfig
from epdserve.models.moe_experts import experts_loop, run_experts
from epdserve.models.qwen3_vl_moe_lm import route

METHODS = ("grouped", "fused", "gathered")


def expert_shapes(model_path: str) -> tuple[int, int, int, int]:
    """``(experts, top_k, hidden, expert width)`` of the checkpoint at ``model_path`` (its ``config.json``, read as
    the servers read it: :meth:`ModelConfig.load`).

    Raises:
        ValueError: not an MoE checkpoint.
    """
    cfg = ModelConfig.load(model_path)
    if not cfg.num_experts:
        raise ValueError(f"{model_path} is not an MoE checkpoint (no experts in its config)")
    return cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size


def _layers(n: int, e: int, k: int, hidden: int, inter: int, tokens: int, dev: torch.device):
    """``n`` layers' expert weights (~N(0, 1/K) so activations stay O(1)) and one routing per layer."""
    out = []
    for i in range(n):
        g = torch.Generator(device=dev).manual_seed(i)
        gate_up = torch.randn(e, 2 * inter, hidden, device=dev, generator=g, dtype=torch.bfloat16) * hidden ** -0.5
        down = torch.randn(e, hidden, inter, device=dev, generator=g, dtype=torch.bfloat16) * inter ** -0.5
        x = torch.randn(tokens, hidden, device=dev, generator=g, dtype=torch.bfloat16)
        weights, experts = route(x, torch.randn(e, hidden, device=dev, generator=g, dtype=torch.bfloat16), k)
        out.append((x, gate_up, down, weights, experts))
    return out


def _time_us(method: str, layers: list, reps: int = 20) -> float:
    """Median microseconds per call of ``method`` over ``layers``, replayed from one CUDA graph."""
    return graph_us_per_call([functools.partial(run_experts, *args, method=method) for args in layers], reps)


def measure(e: int, k: int, hidden: int, inter: int, tokens: int, n_layers: int, bw: float) -> list[dict]:
    """Every method at ``tokens`` rows (see the module docstring); one dict per method."""
    dev = torch.device("cuda")
    layers = _layers(n_layers, e, k, hidden, inter, tokens, dev)
    reached = statistics.mean(int(torch.unique(a[4]).numel()) for a in layers)
    nbytes = reached * 3 * inter * hidden * 2
    want = experts_loop(*[t.float() if t.is_floating_point() else t for t in layers[0]])
    rows, base = [], None
    for method in METHODS:
        if method == "gathered" and tokens * k > 64:  # it copies each slot's weights: ~200 MB a slot-row here
            continue
        err = float((run_experts(*layers[0], method=method).float() - want).abs().max() / want.abs().max())
        row = dict(method=method, tokens=tokens, experts_reached=reached, mb=round(nbytes / 1e6, 2), rel_error=err)
        if err > 2e-2:  # bf16 rounding of the output is ~4e-3; a wrong path is off by O(1)
            rows.append(row | dict(note="wrong result: not timed"))
            continue
        us = _time_us(method, layers)
        base = base or us
        rows.append(row | dict(us=round(us, 2), tb_per_s=round(nbytes / us / 1e6, 3),
                               of_roofline=round(nbytes / bw / (us * 1e-6), 3), vs_grouped=round(us / base, 3)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a table and optionally writes ``--output-json``. Returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="checkpoint directory (only config.json is read)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--layers", type=int, default=12, help="distinct layers' weights per graph (HBM, not L2)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    e, k, hidden, inter = expert_shapes(args.model_path)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw / 1e12:.2f} TB/s; {e} experts, top {k}, "
          f"hidden {hidden}, expert width {inter}")
    rows = []
    for tokens in args.batch_sizes:
        for row in measure(e, k, hidden, inter, tokens, args.layers, bw):
            rows.append(row)
            timing = (f"{row['us']:8.2f} us {row['tb_per_s']:5.2f} TB/s {row['of_roofline']:6.1%} of roofline "
                      f"{row['vs_grouped']:5.2f}x grouped" if "us" in row else row["note"])
            print(f"T={tokens:3d} {row['method']:9s} {row['experts_reached']:6.1f} experts {row['mb']:8.1f} MB "
                  f"{timing}  err {row['rel_error']:.1e}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "copy_bandwidth_tbps": bw / 1e12,
                       "model_path": args.model_path, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
