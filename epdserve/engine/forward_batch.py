"""The one structure a scheduler hands to the model runner: a forward over B requests, tokens flattened."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A model forward over B requests (prefill/extend or decode), their new tokens concatenated.

    Attributes:
        is_decode: every request has exactly one new token (lets backends use decode kernels).
        input_ids: ``[T]`` int64 token ids; rows under ``mm_mask`` are ignored (their embeddings are replaced).
        positions: ``[3, T]`` int64 M-RoPE positions (temporal, height, width); text tokens repeat one value.
        out_slots: ``[T]`` int64 KV slot of each new token, ``page * page_size + offset_in_page``.
        q_lens: per request, new tokens in this forward (sum is ``T``).
        kv_lens: per request, KV length after this forward (cached prefix + new tokens).
        page_table: per request, its KV page ids in order; at least ``ceil(kv_len / page_size)`` of them.
        mm_embeds: image embeddings (any float dtype) replacing token embeddings where ``mm_mask`` is True:
            ``[N, hidden]`` in row order with ``N == mm_mask.sum()``, or ``[T, hidden]`` aligned with the tokens
            (rows outside the mask ignored; what a CUDA graph replays, since it needs no data-dependent shape).
        mm_mask: ``[T]`` bool.
        mm_sources: where each block of ``mm_embeds`` rows came from, in order: ``(rid, image_hash, start,
            end)`` rows of that image's embeddings (lets TP ranks other than 0 gather the same rows from their own
            copy); None when not known.
        last_rows: ``[B]`` int64 row of each request's last new token, on the model's device; None: from
            ``q_lens``. A prefill CUDA graph passes its own buffer, since ``q_lens`` would be frozen into the graph.
        deepstack_embeds: Qwen3-VL's DeepStack features of the same image rows (any float dtype): ``[L, N,
            hidden]`` packed like ``mm_embeds`` (``N == mm_mask.sum()``) or ``[L, T, hidden]`` aligned with the
            tokens, ``L`` = the vision tower's ``deepstack_visual_indexes`` count; level ``i`` is added to the image
            rows' hidden states after decoder layer ``i``. Required with ``mm_embeds`` by a Qwen3-VL model, ignored
            (and None) for Qwen2-VL / Qwen2.5-VL.
        state_slots: hybrid models (Qwen3.5): per request, its :class:`~epdserve.kvcache.state_pool.StatePool`
            slot. The linear-attention layers start from the slot's state and leave the new state there, so an
            extend continues the state of the request's earlier extends (chunked prefill) and a fresh request must
            start from the zero state (a first extend does). A decode CUDA graph passes an int64 device tensor
            ``[B]`` instead of a list. None for models without linear-attention layers.
        state_snapshots: hybrid models, an eager extend: snapshots taken inside this forward, one
            ``(request index, new tokens before the cut, destination slot)`` per request that has one. Each DeltaNet
            layer writes the request's conv and recurrent state as it stands after that many of the request's new
            tokens (0 < cut < q_len) into the destination slot, then carries on to the end: prefill's radix cache
            gets the state at a prompt's last page boundary without a second forward (SGLang's ``extra_buffer``
            mamba scheduling takes its prefix states inside the prefill forward the same way).
    """

    is_decode: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    page_table: list[list[int]]
    mm_embeds: torch.Tensor | None = None
    mm_mask: torch.Tensor | None = None
    mm_sources: list[tuple[str, str, int, int]] | None = None
    last_rows: torch.Tensor | None = None
    deepstack_embeds: torch.Tensor | None = None
    state_slots: list[int] | torch.Tensor | None = None
    state_snapshots: list[tuple[int, int, int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)
