"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. arXiv:1909.08053; as SGLang's and mini-sglang's
``layers/linear.py`` and ``layers/embedding.py``): each TP rank holds a slice of a weight and the layer's
collectives make its output the full layer's.

- :class:`ColumnParallelLinear`: output features split over ranks (q/k/v heads, gate/up); no communication, the
  output stays sharded. Fused projections are several parts, each sliced on its own.
- :class:`RowParallelLinear`: input features split (o_proj, down_proj); partial products summed by an all-reduce.
- :class:`VocabParallelEmbedding`: vocabulary rows split; each rank embeds its rows, zeros elsewhere, all-reduce.
- :class:`ParallelLMHead`: vocabulary rows split; local logits all-gathered into the full vocabulary.

Each sharded layer loads a full checkpoint tensor through ``load_shard(param, tensor, part)``, which takes this
rank's slice. With one rank every layer is the plain ``F.linear``/``F.embedding`` of ``nn.Linear``/``nn.Embedding``
over the full weight and makes no collective, so TP=1 computes bit for bit what it did before.

Heads (:func:`head_shard`): query heads split evenly; KV heads split evenly when there are at least as many as
ranks, else each rank holds one KV head, replicated over ``size / num_kv_heads`` ranks (SGLang's
``QKVParallelLinear``): rank ``r`` holds KV head ``r * num_kv_heads // size``, which serves exactly its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.engine.distributed import TPGroup
from epdserve.models import decode_gemv, parts_gemm


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of one TP rank: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)`` of the model's."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadShard:
    """Split ``num_heads`` query and ``num_kv_heads`` KV heads over ``tp`` (see the module docstring).

    Raises:
        ValueError: ``num_heads`` not divisible by ``tp.size``, or KV heads neither divisible by nor dividing it.
    """
    n, r = tp.size, tp.rank
    if num_heads % n:
        raise ValueError(f"{num_heads} attention heads cannot be split over {n} TP ranks")
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {n} TP ranks")
        kv = num_kv_heads // n
        return HeadShard(num_heads // n, kv, r * num_heads // n, r * kv)
    if n % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {n} TP ranks")
    return HeadShard(num_heads // n, 1, r * num_heads // n, r * num_kv_heads // n)


def split_evenly(size: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """``(start, length)`` of this rank's slice of ``size`` features. Raises ValueError when not divisible."""
    if size % tp.size:
        raise ValueError(f"{what} of {size} cannot be split over {tp.size} TP ranks")
    part = size // tp.size
    return tp.rank * part, part


def _check(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: checkpoint shape {tuple(got)} != expected {tuple(want)}")


class ColumnParallelLinear(nn.Module):
    """``y = x W_r^T + b_r`` where this rank's ``W_r`` is the concatenation of one slice of each part.

    Args:
        in_features: input features (not split).
        parts: per fused part ``(full_out, start, length)``: the part has ``full_out`` output features in the
            checkpoint and this rank keeps ``[start, start + length)`` of them. One part for a plain layer.
        bias: whether there is a bias (sliced like the weight rows).
    """

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool):
        super().__init__()
        self.parts = parts
        out = sum(length for _, _, length in parts)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.fused = False  # CUDA kernels (the model's use_fused_ops): decode-sized products through decode_gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, sum of part lengths]`` (this rank's output features, part after part)."""
        if self.fused:
            return decode_gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        """Copy this rank's rows of checkpoint ``tensor`` (part ``part``, or the only part) into ``param``.

        Raises:
            ValueError: ``tensor`` does not have the part's full shape.
        """
        idx = part or 0
        full, start, length = self.parts[idx]
        _check(f"part {idx}", tensor.shape, (full, *param.shape[1:]))
        offset = sum(p[2] for p in self.parts[:idx])
        param.data[offset:offset + length].copy_(tensor[start:start + length])


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_r^T)``: this rank holds input features ``[r * in/size, (r+1) * in/size)``; no bias
    (Qwen2's o_proj and down_proj have none)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        """Raises ValueError when ``in_features`` is not divisible by ``tp.size``."""
        super().__init__()
        self.tp = tp
        self.start, local = split_evenly(in_features, tp, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.fused = False  # CUDA kernels (the model's use_fused_ops): decode-sized products through decode_gemv

    def forward(self, x: torch.Tensor, reduce: bool = True, parts: bool = False) -> torch.Tensor:
        """``[T, in / size]`` (this rank's features) -> ``[T, out]``, summed over the ranks (``reduce`` False: this
        rank's partial product, for a caller that sums it with others in one all-reduce). ``parts``: for a caller
        whose next kernel sums split-K parts (:func:`~epdserve.models.decode_gemv.norm_gemv`,
        :func:`~epdserve.models.decode_gemv.norm_parts`), a decode-sized ``x`` without TP comes back as float32
        parts ``[S, T, out]`` whose weights load before the kernel ahead of it ends, instead of cuBLAS's GEMM (and
        its split-K reduce kernel): :func:`~epdserve.models.parts_gemm.gemm_parts` where it fits (2 to 128 rows),
        else one row too wide for one GEMV program (``in > decode_gemv.MAX_K``) through
        :func:`~epdserve.models.decode_gemv.down_parts` (the 7B preset's decode step at one row 3.964 against 4.139
        ms on an H200, docs/performance.md, nineteenth session)."""
        if parts and self.fused and self.tp.size == 1:
            if parts_gemm.fits(x, self.weight):
                return parts_gemm.gemm_parts(x, self.weight)
            if x.shape[0] == 1 and x.shape[1] > decode_gemv.MAX_K:
                return decode_gemv.down_parts(x, self.weight)
        y = decode_gemv.linear(x, self.weight) if self.fused else F.linear(x, self.weight)
        return self.tp.all_reduce(y) if reduce else y

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        """Copy this rank's columns of checkpoint ``tensor`` ``[out, in]`` into ``param``. Raises ValueError on a
        shape mismatch."""
        _check("row-parallel weight", tensor.shape, (param.shape[0], param.shape[1] * self.tp.size))
        param.data.copy_(tensor[:, self.start:self.start + param.shape[1]])


class _VocabShard(nn.Module):
    """Vocabulary rows ``[start, start + rows)`` of a ``[vocab, hidden]`` weight; the last rank's shard is padded
    with zero rows when ``vocab`` does not divide evenly."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        """Copy this rank's vocabulary rows of checkpoint ``tensor`` ``[vocab, hidden]``; padding rows are zero.
        Raises ValueError on a shape mismatch."""
        _check("vocabulary weight", tensor.shape, (self.vocab_size, param.shape[1]))
        rows = tensor[self.start:self.start + self.rows]
        if rows.shape[0] < self.rows:
            param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)


class VocabParallelEmbedding(_VocabShard):
    """Token embedding with the vocabulary split over ranks."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 ids -> ``[T, hidden]``: each rank embeds the ids in its rows (zeros for the others), the
        all-reduce adds exact zeros to the one real row."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard):
    """The LM head (``[vocab, hidden]``, no bias) with the vocabulary split over ranks; may share its weight with
    a :class:`VocabParallelEmbedding` (tied embeddings: same rows on the same rank)."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, hidden]`` -> logits ``[B, vocab]`` on every rank (local ``[B, rows]``, all-gathered).

        On CUDA with one rank and bf16/fp16 ``x`` the logits are the GEMM's float32 accumulator (``torch.mm``'s
        ``out_dtype``), written straight into ``out`` where given: no rounding to ``x``'s dtype and no
        cast-and-copy kernel, which took 4 / 14 / 58 us of the 3B preset's decode step at 1 / 32 / 128 rows on an
        H200 (docs/performance.md, nineteenth session). Elsewhere they are in ``x``'s dtype, copied (cast) into
        ``out`` where given.

        Args:
            x: ``[B, hidden]``. out: optional float32 ``[B, vocab]``, contiguous; returned when given.
        """
        if self.tp.size == 1 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            if out is None:
                return torch.mm(x, self.weight.t(), torch.float32)
            if out.dtype == torch.float32 and out.is_contiguous() and out.shape == (x.shape[0], self.rows):
                return torch.mm(x, self.weight.t(), torch.float32, out=out)
        logits = F.linear(x, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]
        return logits if out is None else out.copy_(logits)
