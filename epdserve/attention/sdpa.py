"""Paged attention with torch ``scaled_dot_product_attention``: any device, the reference for other backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epdserve.attention.base import AttentionBackend
from epdserve.engine.forward_batch import ForwardBatch


def request_kv_slots(page_ids: list[int], kv_len: int, page_size: int) -> torch.Tensor:
    """Slots ``[kv_len]`` int64 (CPU) of a request's KV in order, from its page ids.

    Raises:
        ValueError: fewer than ``ceil(kv_len / page_size)`` pages.
    """
    num_pages = -(-kv_len // page_size)
    if len(page_ids) < num_pages:
        raise ValueError(f"kv_len {kv_len} needs {num_pages} pages of {page_size}, page table has {len(page_ids)}")
    pages = torch.tensor(page_ids[:num_pages], dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:kv_len]


@dataclass
class _Plan:
    out_slots: torch.Tensor
    kv_slots: torch.Tensor  # extend: [sum kv_len] concatenated; decode: [B, max kv_len] padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max kv_len] True where a KV slot is real
    spans: list[tuple[int, int, int, int, torch.Tensor | None, bool]]  # q0, q1, kv0, kv1, mask, is_causal


class SdpaBackend(AttentionBackend):
    """Gathers each request's K/V through its page table and runs torch SDPA.

    Extend: one SDPA call per request, with ``is_causal`` when there is no cached prefix and otherwise an
    explicit bottom-right-aligned causal mask (query j sees KV ``0 .. L - q + j``). Decode: one batched SDPA call
    over K/V padded to the longest request, padding masked out.
    """

    _plan: _Plan | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        """Compute KV slots and masks of ``batch``.

        Raises:
            ValueError: a page table too short for its ``kv_len``, or ``q_len`` outside ``1 .. kv_len``.
        """
        ps, dev = self.kv_pool.page_size, self.kv_pool.device
        per_req = [request_kv_slots(p, L, ps) for p, L in zip(batch.page_table, batch.kv_lens)]
        for q, L in zip(batch.q_lens, batch.kv_lens):
            if not 1 <= q <= L:
                raise ValueError(f"q_len {q} must be in 1..kv_len ({L})")
        out_slots = batch.out_slots.to(dev)
        if batch.is_decode:
            max_len = max(batch.kv_lens)
            slots = torch.zeros(len(per_req), max_len, dtype=torch.int64)
            valid = torch.zeros(len(per_req), max_len, dtype=torch.bool)
            for i, s in enumerate(per_req):
                slots[i, :len(s)] = s
                valid[i, :len(s)] = True
            self._plan = _Plan(out_slots, slots.to(dev), valid[:, None, None, :].to(dev), [])
            return
        spans, q0, kv0 = [], 0, 0
        for q, L in zip(batch.q_lens, batch.kv_lens):
            mask = None
            if 1 < q < L:
                mask = (torch.arange(L)[None, :] <= (L - q + torch.arange(q))[:, None]).to(dev)
            spans.append((q0, q0 + q, kv0, kv0 + L, mask, q == L and q > 1))
            q0, kv0 = q0 + q, kv0 + L
        self._plan = _Plan(out_slots, torch.cat(per_req).to(dev), None, spans)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_written: bool = False, early_kv: bool = False) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. Raises RuntimeError when :meth:`prepare` was not called."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("SdpaBackend.forward before prepare")
        if not kv_written:
            self.kv_pool.write(layer_id, plan.out_slots, k, v)
        k_all, v_all = self.kv_pool.slot_view(layer_id)
        gqa = q.shape[1] != k.shape[1]
        if plan.decode_mask is not None:
            keys = k_all[plan.kv_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vals = v_all[plan.kv_slots].transpose(1, 2).to(q.dtype)
            out = F.scaled_dot_product_attention(q[:, :, None, :], keys, vals, attn_mask=plan.decode_mask,
                                                 scale=self.scale, enable_gqa=gqa)
            return out[:, :, 0, :]
        keys, vals = k_all[plan.kv_slots].to(q.dtype), v_all[plan.kv_slots].to(q.dtype)
        out = torch.empty_like(q)
        for q0, q1, kv0, kv1, mask, causal in plan.spans:
            o = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), keys[kv0:kv1].transpose(0, 1), vals[kv0:kv1].transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa)
            out[q0:q1] = o.transpose(0, 1)
        return out
