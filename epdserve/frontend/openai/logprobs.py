"""OpenAI ``logprobs`` of a chat completion: each sampled token's text, exact bytes and log-probability, and the
most likely tokens at its step, from the stages' :class:`~epdserve.wire.messages.TokenLogprob` entries."""

from __future__ import annotations

from epdserve.frontend.openai.protocol import TokenLogprobInfo, TopLogprob
from epdserve.wire.messages import TokenLogprob


class TokenBytes:
    """The exact bytes of a token id. Byte-level BPE vocabularies (GPT-2's, Qwen2's) store each byte as one
    printable character (transformers' ``bytes_to_unicode``); a token holding part of a UTF-8 character has no
    text of its own, so its bytes come from that map. Tokens outside it (added tokens) are their decoded text.

    Args:
        tokenizer: a transformers tokenizer; used from one thread (the gateway's event loop).
    """

    def __init__(self, tokenizer) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._tokenizer = tokenizer
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}  # bounded by the vocabulary

    def __call__(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if piece and all(c in self._byte_of for c in piece):
                out = bytes(self._byte_of[c] for c in piece)
            else:
                out = self._tokenizer.decode([token_id]).encode()
            self._cache[token_id] = out
        return out

    def entry(self, token_id: int, logprob: float, model: type[TopLogprob] = TopLogprob, **extra) -> TopLogprob:
        """``token_id`` as OpenAI's ``{token, logprob, bytes}`` (a ``model``, with its ``extra`` fields)."""
        b = self(token_id)
        return model(token=b.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(b), **extra)


def logprob_content(token_bytes: TokenBytes, token_ids: list[int],
                    logprobs: list[TokenLogprob]) -> list[TokenLogprobInfo]:
    """OpenAI's ``choices[].logprobs.content`` for ``token_ids`` and their stage entries (same length)."""
    return [token_bytes.entry(token_id, lp.logprob, TokenLogprobInfo,
                              top_logprobs=[token_bytes.entry(int(t), float(v)) for t, v in lp.top])
            for token_id, lp in zip(token_ids, logprobs)]
