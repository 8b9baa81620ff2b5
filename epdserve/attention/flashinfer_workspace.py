"""How much float workspace flashinfer's prefill plan takes in CUDA-graph mode (kept apart from
:mod:`epdserve.attention.flashinfer`, which imports flashinfer, so the CPU tests can check it)."""

from __future__ import annotations


def graph_prefill_workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                                  num_sm: int) -> int:
    """Bytes of float workspace that flashinfer's prefill plan in CUDA-graph mode may take for one request of up to
    ``max_tokens`` new tokens: its split-KV partial outputs ``tmp_v`` and ``tmp_s``, ``num_qo_heads * padded_batch *
    cta_tile_q * (head_dim + 1)`` float32, where ``padded_batch = max(2 * num_sm // num_kv_heads, query tiles)``
    (flashinfer 0.6 ``PrefillPlan`` / ``PrefillSplitQOKVIndptr`` in ``attention/scheduler.cuh``; tiles of at most 128
    packed rows, ``max_tokens * num_qo_heads / num_kv_heads`` of them). Qwen3-VL-30B-A3B's 32 query heads over 4 KV
    heads at 2048 tokens asked for 258 MiB (this gives 261 MiB), more than the 256 MiB workspace the other presets
    fit in (the plan then failed: "Buffer overflow when allocating memory for batch_prefill_tmp_s")."""
    rows = max(128 * (2 * num_sm // num_kv_heads), max_tokens * (num_qo_heads // num_kv_heads) + 128)
    return num_qo_heads * rows * (head_dim + 1) * 4 + (1 << 20)
