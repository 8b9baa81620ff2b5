"""Token sampling from last-token logits: greedy, temperature, top-k, top-p (nucleus); OpenAI's logit bias and
presence and frequency penalties; and the sampled tokens' log-probabilities for requests that ask for them."""

from __future__ import annotations

import torch

from epdserve.device import to_device
from epdserve.wire.messages import SamplingParams, TokenLogprob

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows to inf and the
# softmax to NaN, which multinomial rejects, failing every request of the batch.
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[B, V]`` float32; returns int64 ``[B]`` on ``logits.device``.

    Rows with ``0 <= temperature < GREEDY_BELOW`` take ``torch.argmax`` (bit-for-bit the choice of transformers'
    greedy search). Other rows: divide by temperature, keep the ``top_k`` largest (``top_k <= 0`` or ``>= V``: all),
    then the smallest set of tokens whose probability mass reaches ``top_p`` (Holtzman et al., arXiv:1904.09751;
    the top token is always kept), renormalise and draw with ``torch.multinomial``. Rows with a generator draw
    from it (so a seeded request is reproducible whatever it is batched with); the others share one batched
    draw from the global RNG. All filtering is vectorised over the batch with one sort.

    Raises:
        ValueError: ``params``/``generators`` length differs from B, or a negative temperature / top_p not in
            (0, 1].
    """
    B, V = logits.shape
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} logit rows but {len(params)} params and {len(generators)} generators")
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature < 0 or p.temperature >= GREEDY_BELOW]
    if not rows:
        return out
    for i in rows:
        if params[i].temperature < 0 or not 0 < params[i].top_p <= 1:
            raise ValueError(f"bad sampling params {params[i]}")
    dev = logits.device
    # Every per-row parameter goes over in one asynchronous copy: a blocking copy would stall the overlapped
    # decode loop (see epdserve.device.to_device).
    sel = to_device(torch.tensor(rows), dev)
    knobs = to_device(torch.tensor([[params[i].temperature, params[i].top_p,
                                     params[i].top_k if 0 < params[i].top_k < V else V] for i in rows]), dev)
    temps, top_p, ks = knobs[:, 0], knobs[:, 1], knobs[:, 2]
    scaled = logits[sel] / temps[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=dev)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the mass before it already reaches top_p; rank 0 never is (mass before it is 0).
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (ranks > 0) & (top_p[:, None] < 1)
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    picks = torch.empty(len(rows), dtype=torch.int64, device=dev)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if shared:
        shared_t = to_device(torch.tensor(shared), dev)
        picks[shared_t] = torch.multinomial(probs[shared_t], 1).squeeze(1)
    for j, i in enumerate(rows):
        g = generators[i]
        if g is not None:
            picks[j] = torch.multinomial(probs[j].to(g.device), 1, generator=g).to(dev)[0]
    out[sel] = sorted_ids.gather(1, picks[:, None]).squeeze(1)
    return out


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Log-probabilities of ``tokens`` (int64 ``[B]``, sampled from ``logits`` ``[B, V]``) under the model's own
    distribution: ``log_softmax`` of the raw logits in float32, before temperature, top-k and top-p (vLLM's
    default ``raw_logprobs``). Returns device tensors ``(chosen [B] float32, top values [B, K] float32, top ids
    [B, K] int64)`` with ``K`` the largest ``logprobs`` asked in ``params``, or None when no row asks (no work).
    Turn them into messages with :func:`token_logprobs` once the device has computed them."""
    k = max((p.logprobs for p in params), default=-1)
    if k < 0:
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.to(lp.device)[:, None]).squeeze(1)
    top_v, top_i = lp.topk(k, dim=-1)  # k == 0: empty [B, 0]
    return chosen, top_v, top_i


def token_logprobs(logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                   params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Per row, the :class:`TokenLogprob` of a :func:`sampled_logprobs` result (copied to the host here), with
    ``params[i].logprobs`` top entries; None for rows that did not ask."""
    if logprobs is None:
        return [None] * len(params)
    chosen, top_v, top_i = (t.tolist() for t in logprobs)
    return [None if p.logprobs < 0 else
            TokenLogprob(chosen[i], [[t, v] for t, v in zip(top_i[i][:p.logprobs], top_v[i][:p.logprobs])])
            for i, p in enumerate(params)]


def has_penalties(params: list[SamplingParams]) -> bool:
    """Whether any request of a batch has a presence or frequency penalty (else :func:`apply_penalties` is not
    needed)."""
    return any(p.frequency_penalty or p.presence_penalty for p in params)


def apply_penalties(logits: torch.Tensor, output_ids: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over each request's output tokens so far (not the prompt):
    ``logits[t] - frequency_penalty * count(t) - presence_penalty * (count(t) > 0)``, the formula of OpenAI's API
    reference and vLLM's ``apply_penalties``.

    Args:
        logits: ``[B, V]`` float32 (not modified).
        output_ids: ``[B, L]`` int64 on ``logits.device``, each row's output ids, padded with -1.
        params: per row.

    Returns:
        New ``[B, V]`` float32 logits.
    """
    B, V = logits.shape
    dev = logits.device
    ids = output_ids.masked_fill(output_ids < 0, V)  # pads count in a column that is dropped
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=dev)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :V]
    knobs = to_device(torch.tensor([[p.frequency_penalty, p.presence_penalty] for p in params]), dev)
    return logits - knobs[:, :1] * counts - knobs[:, 1:] * (counts > 0)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each row's ``[token id, bias]`` pairs added to its logits (``[B, V]`` float32, not
    modified; a new tensor is returned, or ``logits`` itself when no row has a bias). Ids outside the
    vocabulary are ignored (the gateway refuses them)."""
    V = logits.shape[1]
    entries = [(i, int(t), float(b)) for i, p in enumerate(params) for t, b in p.logit_bias if 0 <= int(t) < V]
    if not entries:
        return logits
    rows, ids, bias = zip(*entries)
    flat = to_device(torch.tensor(rows, dtype=torch.int64) * V + torch.tensor(ids, dtype=torch.int64), logits.device)
    out = logits.clone()
    out.view(-1).index_add_(0, flat, to_device(torch.tensor(bias, dtype=logits.dtype), logits.device))
    return out


def choice_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of choice ``index`` of a request seeded with ``seed`` (None: unseeded, so None): seeded with
    ``seed + index``, wrapped into the unsigned 64-bit range ``torch.Generator.manual_seed`` takes, so choice 0
    of any request draws exactly what an ``n == 1`` request with the same seed draws."""
    if seed is None:
        return None
    s = seed + index
    return torch.Generator(device=device).manual_seed(s if s < 1 << 64 else s - (1 << 64))
