"""The first output tokens of prefilled requests: sampled from the logits of each prompt's last position, under
the request's logit bias and, for a constrained request, its grammar's token bitmask; ``n`` of them for a request
of ``n`` choices (one row per choice, choice ``i`` drawing from seed ``seed + i``)."""

from __future__ import annotations

import torch

from epdserve.engine.grammar import mask_logits
from epdserve.engine.sampling import apply_logit_bias, choice_generator, sample, sampled_logprobs, token_logprobs
from epdserve.prefill.records import PrefillRecord
from epdserve.wire.messages import TokenLogprob


def sample_first_tokens(rows: torch.Tensor, reqs: list[PrefillRecord]
                        ) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
    """Per request of ``reqs`` (whose matchers, if constrained, are started), its choices' first tokens (one for
    ``n == 1``) and, when it asked, each token's log-probability under the raw logits. ``rows`` is
    ``[len(reqs), V]`` float32, one prompt's last-position logits per row; a request of ``n`` choices takes its row
    ``n`` times (every choice starts from the same grammar state, so one matcher fills all of their masks). Waits
    for the device (``.tolist()``), so the pages hold the whole KV before any decode server is told."""
    counts = [r.msg.sampling.n for r in reqs]
    expanded = [(r, i) for r in reqs for i in range(r.msg.sampling.n)]
    if len(expanded) != len(reqs):
        rows = rows.repeat_interleave(torch.tensor(counts, device=rows.device), dim=0)
    gens = [choice_generator(r.msg.sampling.seed, i, rows.device) for r, i in expanded]
    params = [r.msg.sampling for r, _ in expanded]
    adjusted = mask_logits(apply_logit_bias(rows, params), [r.constraint for r, _ in expanded])
    first_t = sample(adjusted, params, gens)
    lp = sampled_logprobs(rows, first_t, params)
    flat, flat_lp = first_t.tolist(), token_logprobs(lp, params)
    tokens, logprobs, at = [], [], 0
    for n in counts:
        tokens.append(flat[at:at + n])
        logprobs.append(flat_lp[at:at + n])
        at += n
    return tokens, logprobs
