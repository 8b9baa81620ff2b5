"""The graph prefills' float workspace (epdserve.attention.flashinfer_workspace) against what flashinfer's plan asked
for on an H200 (132 SMs): the presets that ran in 256 MiB stay within it, and Qwen3-VL-30B-A3B's plan, which failed
there wanting 256 MiB of tmp_v plus 2 MiB of tmp_s (32 heads x 128 padded tiles x 128 rows x (128 + 1) floats), fits."""

from __future__ import annotations

import pytest

from epdserve.attention.flashinfer_workspace import graph_prefill_workspace_bytes

MB = 1 << 20
H200_SMS = 132


@pytest.mark.parametrize("preset,heads,kv_heads", [("qwen2.5-vl-3b", 16, 2), ("qwen2.5-vl-7b", 28, 4),
                                                   ("qwen3-vl-8b", 32, 8)])
def test_presets_that_ran_fit_the_default_workspace(preset, heads, kv_heads):
    assert graph_prefill_workspace_bytes(heads, kv_heads, 128, 2048, H200_SMS) <= 256 * MB, preset


def test_the_30b_a3b_plan_that_overflowed_fits():
    need = graph_prefill_workspace_bytes(32, 4, 128, 2048, H200_SMS)
    asked = 32 * 128 * 128 * 128 * 4 + 32 * 128 * 128 * 4  # flashinfer's tmp_v and tmp_s in the failed plan
    assert asked > 256 * MB and need >= asked
    assert need < asked + 8 * MB  # sized to the plan, not a blanket multiple


def test_small_prefills_are_bounded_by_the_split_kv_batch():
    # one token: flashinfer pads the batch to 2 * SMs / KV heads tiles of up to 128 rows
    assert graph_prefill_workspace_bytes(16, 2, 128, 1, H200_SMS) == 16 * 128 * 132 * 129 * 4 + MB
