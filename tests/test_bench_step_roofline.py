"""The step bench (benchmarks/step.py): its memory roofline for MoE models (routed experts count in the share a
step's tokens reach, the rest of the LM in full; dense models unchanged), and its overlapped decode loop."""

from __future__ import annotations

import random

import pytest
import torch

from epdserve.bench.step import (active_weights, critical_path, expected_experts, lm_params, lm_weights, step_bytes,
                                 time_steps)
from epdserve.engine.model_runner import ModelRunner
from epdserve.models.tiny import make_tiny_model


def test_expected_experts_matches_a_simulation_of_uniform_top_k_routing():
    rng = random.Random(0)
    for E, k, T in ((128, 8, 1), (128, 8, 32), (32, 2, 7), (16, 2, 128)):
        trials = 2000
        seen = sum(len({e for _ in range(T) for e in rng.sample(range(E), k)}) for _ in range(trials)) / trials
        want = expected_experts(E, k, T)
        assert abs(seen - want) < 0.02 * E, (E, k, T, seen, want)
    assert expected_experts(128, 8, 1) == pytest.approx(8)  # one token reads exactly its top-k
    assert expected_experts(128, 8, 0) == 0.0


def test_critical_path_takes_out_the_overlap_of_early_launched_kernels():
    # a: 0-10; b launched early under PDL at 4, waits for a, ends 15; a gap; c 18-20; a again 20-30 with d inside it
    spans = [("b", 4.0, 15.0), ("a", 0.0, 10.0), ("c", 18.0, 20.0), ("a", 20.0, 30.0), ("d", 22.0, 25.0)]
    exclusive, idle = critical_path(spans)
    assert exclusive == {"a": 20.0, "b": 5.0, "c": 2.0, "d": 0.0}
    assert idle == 3.0
    assert sum(exclusive.values()) + idle == 30.0  # the span from the first start to the last end
    assert critical_path([]) == ({}, 0.0)


@pytest.fixture(scope="module")
def moe_runner(tmp_path_factory) -> ModelRunner:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), arch="qwen3_vl_moe")
    return ModelRunner(str(path), device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=16)


def test_moe_roofline_counts_the_experts_the_tokens_reach(moe_runner):
    cfg = moe_runner.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    weights = lm_weights(moe_runner)
    routed = [p for p, share in active_weights(moe_runner, 1) if share != 1.0]
    assert routed and all(p.shape[0] == E for p in routed)  # the fused [E, ...] expert tensors, nothing else
    dense_bytes = sum(p.numel() * p.element_size() for p in weights)
    routed_bytes = sum(p.numel() * p.element_size() for p in routed)
    for batch in (1, 4, 64):
        got = step_bytes(moe_runner, kv_tokens=0, batch_size=batch)
        want = dense_bytes - routed_bytes * (1 - expected_experts(E, k, batch) / E)
        assert got == pytest.approx(want)
    assert step_bytes(moe_runner, 0, 1) < step_bytes(moe_runner, 0, 64) < dense_bytes
    per_token = sum(p.numel() for p in weights) - sum(p.numel() for p in routed) * (1 - k / E)
    assert lm_params(moe_runner) == pytest.approx(per_token)


def test_dense_roofline_counts_every_weight(tiny_model_path):
    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=16,
                         page_size=16)
    assert all(share == 1.0 for _, share in active_weights(runner, 32))
    assert step_bytes(runner, 0, 32) == sum(p.numel() * p.element_size() for p in lm_weights(runner))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_overlapped_steps_decode_what_serial_steps_decode(tiny_model_path, batch_size):
    # The overlapped loop feeds each step the previous step's tokens on the device, never through the host: the
    # same greedy tokens as the serial loop (same random KV and first ids), step by step to the last.
    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=64,
                         page_size=16)
    torch.manual_seed(0)
    serial_walls, serial = time_steps(runner, batch_size, 20, 6)
    torch.manual_seed(0)
    walls, overlapped = time_steps(runner, batch_size, 20, 6, overlap=True)
    assert overlapped == serial and len(serial) == batch_size
    assert len(walls) == len(serial_walls) == 6 and min(walls) > 0
    torch.manual_seed(1)
    assert time_steps(runner, batch_size, 20, 6, overlap=True)[1] != serial  # other first ids, other tokens
