"""OpenAI ``logprobs`` of a chat completion: each sampled token's text, exact bytes and log-probability, and the
most likely tokens at its step, from the stages' :class:`~epdserve.wire.messages.TokenLogprob` entries."""

from __future__ import annotations

from epdserve.frontend.detokenizer import TokenBytes
from epdserve.frontend.openai.protocol import TokenLogprobInfo, TopLogprob
from epdserve.wire.messages import TokenLogprob


def _entry(token_bytes: TokenBytes, token_id: int, logprob: float, model: type[TopLogprob] = TopLogprob,
           **extra) -> TopLogprob:
    """``token_id`` as OpenAI's ``{token, logprob, bytes}`` (a ``model``, with its ``extra`` fields)."""
    b = token_bytes(token_id)
    return model(token=b.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(b), **extra)


def logprob_content(token_bytes: TokenBytes, token_ids: list[int],
                    logprobs: list[TokenLogprob]) -> list[TokenLogprobInfo]:
    """OpenAI's ``choices[].logprobs.content`` for ``token_ids`` and their stage entries (same length)."""
    return [_entry(token_bytes, token_id, lp.logprob, TokenLogprobInfo,
                   top_logprobs=[_entry(token_bytes, int(t), float(v)) for t, v in lp.top])
            for token_id, lp in zip(token_ids, logprobs)]
