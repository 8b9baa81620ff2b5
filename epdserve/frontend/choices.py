"""The ``n`` choices of one request at a front: its outputs demultiplexed by ``TokenOutput.index`` (one decode fork
each, see ``decode/forks.py``), detokenized and cut at stop strings per choice, and counted for the usage.

A choice whose text hits a stop string ends here; the front then tells decode to stop that fork alone
(``Stages.abort_choice``: an ``AbortRequest`` with the choice's index), and its outputs still in flight are
dropped. Once every choice has ended the request's lifetime aborts whatever still runs. Usage counts the prompt once and sums the choices' completion tokens, as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from epdserve.frontend.detokenizer import IncrementalDetokenizer
from epdserve.frontend.errors import APIError
from epdserve.wire.messages import TokenLogprob, TokenOutput


def check_n(n: int, max_n: int, param: str = "n") -> None:
    """Refuse ``n`` choices over the server's ``--max-n`` (``n < 1`` is the request schema's to refuse).

    Raises:
        APIError: 400 naming the limit.
    """
    if n > max_n:
        raise APIError(400, f"n is {n}, but this server allows at most {max_n} choices per request (--max-n)",
                       param=param)


@dataclass
class ChoiceResult:
    """One whole choice: its text, output ids, their log-probabilities (empty unless asked) and its last output
    (finish reason, its own completion-token count)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: TokenOutput | None = None


class Choices:
    """The choices of one request in flight: a detokenizer and a finish per choice.

    Args:
        n: the request's choices.
        make_detok: a fresh :class:`IncrementalDetokenizer` (the request's stop strings).
    """

    def __init__(self, n: int, make_detok: Callable[[], IncrementalDetokenizer]):
        self.detoks = [make_detok() for _ in range(n)]
        self.finals: list[TokenOutput | None] = [None] * n
        self.counted = [0] * n  # output ids the client has seen, per choice

    @property
    def done(self) -> bool:
        """Whether every choice has ended."""
        return all(f is not None for f in self.finals)

    def feed(self, out: TokenOutput) -> tuple[str, TokenOutput] | None:
        """``out``'s text delta and ``out`` as the client sees it (:func:`detokenize`), or None for an output of a
        choice that has already ended (at a stop string) or of no choice of this request."""
        i = out.index
        if not 0 <= i < len(self.finals) or self.finals[i] is not None:
            return None
        text, out = detokenize(self.detoks[i], out)
        self.counted[i] += len(out.token_ids)
        if out.finish_reason is not None:
            self.finals[i] = out
        return text, out

    def completion_tokens(self) -> int:
        """Completion tokens of all choices: each ended choice's stage count (its own ids' fallback), the ids seen
        of the others."""
        return sum((f.completion_tokens or c) if f is not None else c for f, c in zip(self.finals, self.counted))


async def collect_choices(outputs: AsyncIterator[tuple[str, TokenOutput]], n: int) -> list[ChoiceResult]:
    """Every choice of a request whose ``(text delta, output)`` pairs are ``outputs`` (``ChatService.outputs``),
    in index order; only those that had an output (a PD prefill leg's answer is choice 0's first token alone)."""
    results = [ChoiceResult(i) for i in range(n)]
    async for text, out in outputs:
        r = results[out.index]
        r.text += text
        r.token_ids += out.token_ids
        r.logprobs += out.logprobs
        r.final = out
    return [r for r in results if r.final is not None]


def detokenize(detok: IncrementalDetokenizer, out: TokenOutput) -> tuple[str, TokenOutput]:
    """Feed ``out``'s ids to ``detok``; return the text delta and ``out`` as the client sees it. On a stop string
    that is ``out`` cut after the id that completed it, with ``finish_reason="stop"`` and ``completion_tokens``
    counting no id after it."""
    parts: list[str] = []
    hit = False
    used = 0
    for token_id in out.token_ids:
        delta, hit = detok.add(token_id)
        parts.append(delta)
        used += 1
        if hit:
            break
    if out.finish_reason not in (None, "error") and not hit:
        delta, hit = detok.flush()
        parts.append(delta)
    if hit:
        unused = len(out.token_ids) - used
        out = replace(out, token_ids=out.token_ids[:used], logprobs=out.logprobs[:used], finish_reason="stop",
                      completion_tokens=max(out.completion_tokens - unused, 0))
    return "".join(parts), out


async def prepend(first: TokenOutput, rest: AsyncIterator[TokenOutput]) -> AsyncIterator[TokenOutput]:
    """Yield ``first``, then ``rest`` unless ``first`` already ended the request."""
    try:
        yield first
        if not first.ends_request:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()
