"""The first output token of prefilled requests: sampled from the logits of each prompt's last position, under
the request's logit bias and, for a constrained request, its grammar's token bitmask."""

from __future__ import annotations

import torch

from epdserve.engine.grammar import mask_logits
from epdserve.engine.sampling import apply_logit_bias, sample, sampled_logprobs, token_logprobs
from epdserve.prefill.records import PrefillRecord
from epdserve.wire.messages import TokenLogprob


def sample_first_tokens(rows: torch.Tensor, reqs: list[PrefillRecord]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Per request of ``reqs`` (whose matchers, if constrained, are started), its first token and, when it asked,
    the token's log-probability under the raw logits. ``rows`` is ``[len(reqs), V]`` float32, one prompt's
    last-position logits per row. Waits for the device (``.tolist()``), so the pages hold the whole KV before any
    decode server is told."""
    gens = []
    for r in reqs:
        seed = r.msg.sampling.seed
        gens.append(None if seed is None else torch.Generator(device=rows.device).manual_seed(seed))
    params = [r.msg.sampling for r in reqs]
    adjusted = mask_logits(apply_logit_bias(rows, params), [r.constraint for r in reqs])
    first_t = sample(adjusted, params, gens)
    lp = sampled_logprobs(rows, first_t, params)
    return first_t.tolist(), token_logprobs(lp, params)
