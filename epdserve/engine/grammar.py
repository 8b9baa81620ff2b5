"""Structured outputs on the prefill and decode servers: a request's :class:`~epdserve.wire.messages.GrammarSpec`
compiled with xgrammar (Dong et al., "XGrammar", arXiv:2411.15100; the engine SGLang and vLLM use) against the
checkpoint's tokenizer, one matcher per request, and the token bitmask applied to the logits where tokens are
sampled (prefill's first token, every decode step).

Compilation runs on one worker thread, never in the scheduler loop: a request's :class:`Constraint` holds a
future, and the schedulers admit (decode) or sample (prefill) it once the future is done. Compiled grammars are
cached by their kind and text, so a schema repeated by many requests compiles once. A grammar that fails to
compile fails its request only.

xgrammar is imported on first use: servers that never see a constrained request do not pay for loading it.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from epdserve.device import to_device
from epdserve.wire.messages import GrammarSpec

log = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; clients get the message after it.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


# xgrammar 0.2 writes the characters of a string with minLength/maxLength as [^"\\\r\n], which lets raw control
# characters (U+0000-U+001F) through: JSON forbids them in strings (json.loads refuses the output). Such strings get
# JSON's own class instead (no escapes either way: the bounded rule counts characters).
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


class GrammarError(ValueError):
    """xgrammar rejected a grammar (a schema it does not support, a regex or EBNF that does not parse)."""


def library_message(e: Exception) -> str:
    """xgrammar's error message without its C++ source location (what a client is shown)."""
    return _CPP_PREFIX.sub("", str(e).strip()).strip()


def build_grammar(spec: GrammarSpec) -> Any:
    """``spec`` as an ``xgrammar.Grammar`` (no tokenizer needed: this is the check the gateway runs).

    JSON is compact (``any_whitespace=False``: ``", "`` and ``": "`` separators, no other whitespace), so a model
    cannot spend its whole budget on whitespace, and xgrammar's ``strict_mode`` forbids properties and items the
    schema does not name, so every output validates against the schema. ``structural_tag``: xgrammar's
    structural-tag JSON (``{"type": "structural_tag", "format": ...}``), e.g. the tool calls of
    :mod:`epdserve.frontend.tools`.

    Raises:
        GrammarError: xgrammar rejects it (its message, see :func:`library_message`), or an unknown kind.
    """
    import xgrammar as xgr

    try:
        if spec.type == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            ebnf = str(grammar)
            if _LOOSE_STRING_CHARS in ebnf:
                grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS))
            return grammar
        if spec.type == "json_object":
            # Any JSON object (OpenAI's json_object mode): the schema of an object with any properties.
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.type == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.type == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.type == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError for C++ parse errors
        raise GrammarError(library_message(e)) from None
    raise GrammarError(f"unknown grammar kind {spec.type!r}")


class GrammarCompiler:
    """Compiles grammars for one checkpoint's tokenizer on a worker thread, with an LRU cache of the results.

    Args:
        model_path: the checkpoint (its tokenizer files are loaded on first use, on the worker thread).
        vocab_size: the model's logits width (may exceed the tokenizer's length: padded embeddings).
        stop_token_ids: the ids that end a generation (the model config's EOS ids): a grammar allows them only
            where it may end.
        cache_size: compiled grammars kept (the oldest go first).
    """

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        self.model_path, self.vocab_size, self.stop_token_ids = model_path, vocab_size, list(stop_token_ids)
        self.cache_size = cache_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epdserve-grammar")
        self._compiler = None  # xgrammar.GrammarCompiler, built on the worker thread
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of ``spec``'s ``xgrammar.CompiledGrammar`` (shared by every request with the same grammar);
        its exception is a :class:`GrammarError` when xgrammar rejects the grammar. Call from one thread (the
        scheduler's)."""
        key = (spec.type, spec.text)
        fut = self._cache.get(key)
        if fut is None:
            fut = self._cache[key] = self._executor.submit(self._compile, spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return fut

    def close(self) -> None:
        """Stop the worker thread (queued compilations are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        grammar = build_grammar(spec)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(library_message(e)) from None


class Constraint:
    """One request's grammar state: the compilation future, then its ``xgrammar.GrammarMatcher``.

    Call :meth:`start` once :meth:`ready`; afterwards :meth:`accept` every output token in order (prefill's first
    token included) and :meth:`fill` the bitmask row before sampling the next one.
    """

    def __init__(self, future: Future):
        self._future = future
        self.matcher = None

    def ready(self) -> bool:
        """Whether compilation has finished (successfully or not)."""
        return self._future.done()

    def start(self) -> str | None:
        """Create the matcher (call once :meth:`ready`); returns an error message when compilation failed."""
        import xgrammar as xgr

        try:
            self.matcher = xgr.GrammarMatcher(self._future.result())
        except GrammarError as e:
            return f"grammar rejected: {e}"
        except Exception as e:  # noqa: BLE001  (a compiler failure must fail this request, not the server)
            log.exception("grammar compilation failed")
            return f"grammar compilation failed: {e}"
        return None

    def fork(self) -> Constraint:
        """A constraint over the same compiled grammar for another choice of the request (``n > 1``), its matcher
        started (call on a started one: compilation has succeeded)."""
        other = Constraint(self._future)
        other.start()
        return other

    def accept(self, token: int) -> bool:
        """Advance the matcher over ``token``; False when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """Whether the grammar has ended (it accepted a stop token): the request finishes with ``"stop"``."""
        return self.matcher.is_terminated()


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """``logits`` ``[B, V]`` with the tokens each row's grammar forbids set to ``-inf`` (xgrammar's token bitmask:
    int32 ``[B, ceil(V / 32)]``, filled on the host, copied to the device asynchronously and applied there with
    ``xgrammar.apply_token_bitmask_inplace``; its CUDA kernel on a GPU).

    Rows whose entry is None (unconstrained requests) or whose matcher is absent or has ended are left as they
    are. Returns ``logits`` itself when no row is constrained (no work), else a new tensor: the raw logits stay
    intact for log-probabilities, and a CUDA graph's output buffer is never written. Makes no blocking
    host-device copy: the decode step's forward may still be running.
    """
    rows = [i for i, c in enumerate(constraints) if c is not None and c.matcher is not None and not c.terminated]
    if not rows:
        return logits
    import xgrammar as xgr

    B, V = logits.shape
    bitmask = xgr.allocate_token_bitmask(B, V)  # every token allowed: the rows left unfilled mask nothing
    for i in rows:
        constraints[i].matcher.fill_next_token_bitmask(bitmask, i)
    out = logits.clone()
    # Every row, no ``indices``: xgrammar copies a list of indices to the GPU with a blocking copy, which waits
    # for the whole stream (the step's forward included) and so took the overlap scheduler's lead away.
    xgr.apply_token_bitmask_inplace(out, to_device(bitmask, out.device))
    return out


def constraint_for(grammars: GrammarCompiler | None, spec: GrammarSpec | None) -> Constraint | None:
    """The :class:`Constraint` of a request with grammar ``spec`` (None: unconstrained), its compilation queued on
    ``grammars``; without a compiler (a scheduler built without one) the constraint fails its request."""
    if spec is None:
        return None
    if grammars is None:
        fut: Future = Future()
        fut.set_exception(GrammarError("structured outputs are not enabled on this server"))
        return Constraint(fut)
    return Constraint(grammars.compile(spec))
