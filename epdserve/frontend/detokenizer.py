"""Incremental detokenization with stop strings, in the gateway (the decode server sends token ids only).

Invariant: the concatenation of all returned deltas equals ``tokenizer.decode(ids, skip_special_tokens=True)``
of the ids added, cut before the first matched stop string.

Algorithm: vLLM's ``detokenize_incrementally`` (``vllm/transformers_utils/detokenizer_utils.py``, after Hugging
Face TGI). Each id is converted to its token string once (``convert_ids_to_tokens``; special tokens are dropped
there, which is what ``skip_special_tokens=True`` means). Text comes from ``convert_tokens_to_string`` over a
short window ``tokens[prefix_offset:]``; the new text is what that window decodes to beyond
``tokens[prefix_offset:read_offset]`` (the tokens released the step before, kept as left context because
decoders such as SentencePiece's decide spaces from the neighbours; the reference decodes the output ids alone,
so unlike vLLM the window does not start inside the prompt). While the window's text ends in U+FFFD (the start of
a UTF-8 character that later byte tokens may complete) nothing is released and the window grows; otherwise both
offsets move forward, so each token costs O(window) tokens of decoding, not O(all tokens so far).

Two additions for byte-level decoders (Qwen's), whose text is the lossy UTF-8 decoding of the tokens' bytes and
so needs no left context: the window restarts at the read offset (one token per step instead of several), and a
window that keeps ending in U+FFFD (a model emitting invalid bytes, or the character U+FFFD itself), which vLLM
lets grow without bound, is split before its newest token when decoding the two parts separately gives the same
text. Then no UTF-8 sequence crosses the split, the text before it is final, and the window moves past it.

Text that may still change or may still turn out to start a stop string is held back: the window's pending
U+FFFD tail and, when stop strings are set, the last ``max(len(stop)) - 1`` characters. :meth:`flush` releases
it at the end. :class:`TokenBytes` gives a token's exact bytes (for log-probabilities).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


def special_ids(tokenizer) -> frozenset[int]:
    """Ids that ``tokenizer.decode(ids, skip_special_tokens=True)`` drops: the added tokens marked special.

    The flag comes from the Rust tokenizer's added vocabulary (``added_tokens_decoder``), the same one its
    ``decode`` filters on; compute it once per tokenizer (it walks the added vocabulary).
    """
    return frozenset(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


class IncrementalDetokenizer:
    """Turns a growing sequence of token ids into text deltas, cut at the first stop string.

    Not thread-safe; one per request.

    Args:
        tokenizer: a Hugging Face fast tokenizer (``convert_ids_to_tokens``, ``convert_tokens_to_string``,
            ``added_tokens_decoder``).
        stop: stop strings; the output ends before the first one found.
        skip_ids: the ids to drop as special tokens; ``special_ids(tokenizer)`` when None (pass it in to
            compute it once per tokenizer rather than once per request).
    """

    def __init__(self, tokenizer, stop: list[str], skip_ids: frozenset[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_ids = special_ids(tokenizer) if skip_ids is None else skip_ids
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.byte_level = _is_byte_level(tokenizer)
        self.tokens: list[str] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # the text of tokens[prefix_offset:read_offset]
        self.unsent = ""  # final text not returned yet (held back for stop strings)
        self.stopped = False

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append ``token_id``; return ``(text delta, stop string hit)``. After a hit, add nothing more.

        Ids the tokenizer does not know produce no text, as in ``decode``.
        """
        if self.stopped:
            raise RuntimeError("a stop string was already matched")
        token = None if token_id in self.skip_ids else self.tokenizer.convert_ids_to_tokens(token_id)
        pending = ""
        if token:
            self.tokens.append(token)
            pending = self._advance()
        return self._release(pending, final=False)

    def flush(self) -> tuple[str, bool]:
        """Return everything held back (an incomplete character's U+FFFD included, as ``decode`` gives it),
        cut at a stop string; ``(text, stop string hit)``. Call once, after the last :meth:`add`."""
        if self.stopped:
            return "", True
        tail = self._convert(self.prefix_offset, len(self.tokens))[len(self.prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.prefix_text = ""
        self.unsent += tail
        return self._release("", final=True)

    # ---- internals ----------------------------------------------------------------------------------------
    def _convert(self, start: int, end: int) -> str:
        return self.tokenizer.convert_tokens_to_string(self.tokens[start:end]) if end > start else ""

    def _move(self, read: int, text: str) -> None:
        """Release ``text`` (final, the window's text up to token ``read``) and move the window past it."""
        self.unsent += text
        if self.byte_level:
            # Byte-level decoding needs no left context once ``read`` is a character boundary (it is: the text
            # up to it is final), so the window restarts there.
            self.prefix_offset = self.read_offset = read
            self.prefix_text = ""
        else:
            self.prefix_offset, self.read_offset = self.read_offset, read
            self.prefix_text = self._convert(self.prefix_offset, self.read_offset)

    def _advance(self) -> str:
        """Decode the window after a new token; move final text to ``unsent``. Returns the window's text that is
        not final yet but can already match a stop string (trailing U+FFFD stripped: only those may change)."""
        end = len(self.tokens)
        new_text = self._convert(self.prefix_offset, end)
        if len(new_text) > len(self.prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._move(end, new_text[len(self.prefix_text):])
            return ""
        split = end - 1
        if self.byte_level and new_text.endswith(_REPLACEMENT) and split > self.read_offset:
            head, tail = self._convert(self.prefix_offset, split), self._convert(split, end)
            if head + tail == new_text and len(head) >= len(self.prefix_text):
                self._move(split, head[len(self.prefix_text):])
                return tail.rstrip(_REPLACEMENT)
        return new_text[len(self.prefix_text):].rstrip(_REPLACEMENT)

    def _release(self, pending: str, *, final: bool) -> tuple[str, bool]:
        """Cut at the first stop string in ``unsent + pending``; return what may be sent now."""
        if self.stop:
            # A stop string can only start in text not yet sent: the last `hold` characters are never sent
            # before the next token, so a match ending in new text starts at or after the sent text.
            text = self.unsent + pending
            cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
            if cuts:
                self.stopped = True
                out, self.unsent = text[:min(cuts)], ""
                return out, True
        keep = 0 if final else self.hold
        cut = max(0, len(self.unsent) - keep)
        out, self.unsent = self.unsent[:cut], self.unsent[cut:]
        return out, False


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
