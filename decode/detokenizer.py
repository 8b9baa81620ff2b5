"""Incremental detokenization with stop strings, for streaming.

Invariant: the concatenation of all returned deltas equals ``tokenizer.decode(ids, skip_special_tokens=True)``
of the final ids, cut before the first matched stop string. To keep it, text that may still change is held
back: a trailing U+FFFD (an incomplete UTF-8 sequence of byte-level BPE that later tokens may complete, as in
vLLM's detokenizer) and, when stop strings are set, the last ``max(len(stop)) - 1`` characters (they may be the
start of a stop string).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: stop strings; the output ends before the first one found.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token_id: int, *, final: bool) -> tuple[str, bool]:
        """Append ``token_id``; return ``(text delta, stop string hit)``. After a hit or ``final`` the whole
        remaining text is flushed and nothing more should be added."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hit = False
        if self.stop:
            # A stop string can only start in text not yet sent, or straddle its start.
            start = max(0, len(self.sent) - self.hold)
            cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if cuts:
                text, hit = text[:min(cuts)], True
        if not (final or hit):
            text = text.rstrip("\ufffd")
            text = text[:max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent):
            # Only possible if the tokenizer's decode is not prefix-stable; never resend text.
            return "", hit
        delta = text[len(self.sent):]
        self.sent = text
        return delta, hit
