"""Structured outputs on the prefill and decode servers: a request's :class:`~epdserve.wire.messages.GrammarSpec`
compiled with xgrammar (Dong et al., "XGrammar", arXiv:2411.15100; the engine SGLang and vLLM use) against the
checkpoint's tokenizer, one matcher per request, and the token bitmask applied to the logits where tokens are
sampled (prefill's first token, every decode step).

Compilation runs on one worker thread, never in the scheduler loop: a request's :class:`Constraint` holds a
future, and the schedulers admit (decode) or sample (prefill) it once the future is done. Compiled grammars are
cached by their kind and text, so a schema repeated by many requests compiles once. A grammar that fails to
compile fails its request only.

Each step's host work is two batched xgrammar calls (:class:`GrammarMasker`): one fills every constrained row's
bitmask (``BatchGrammarMatcher`` on the calling thread), one advances every matcher over its sampled token
(:func:`accept_tokens`); the bitmask lives in one reused (pinned, on CUDA) host buffer and reaches the device in one
asynchronous copy. The grammars see the tokenizer's own ids only (:func:`grammar_vocab_size`): the ids a
checkpoint pads its logits with are masked on the device instead, since xgrammar handles each of them one by one in
every fill and every accept.

xgrammar is imported on first use: servers that never see a constrained request do not pay for loading it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from epdserve.engine.grammar_build import GrammarError, build_grammar, library_message
from epdserve.wire.messages import GrammarSpec

log = logging.getLogger(__name__)

# One thread fills every row. xgrammar's BatchGrammarMatcher starts a new thread pool at every call with threads
# (cpp/grammar_matcher.cc: a pool "cannot be reused after Join()") and queues one task per row: on an H200 host (16
# cores) one row's fill took 37 us on one thread and 1-3.8 ms on 2-8, a 32-row decode step's fill 8 ms on 8 threads
# against 0.9 ms on one (docs/performance.md, "2026-11-29, eleventh session"). Its calls hold the GIL, so Python
# threads cannot overlap them with the scheduler's other host work either.
_FILL_THREADS = 1


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
            size = grammar_vocab_size(tokenizer, self.vocab_size, self.stop_token_ids)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        grammar = build_grammar(spec)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(library_message(e)) from None


def grammar_vocab_size(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> int:
    """The ids the grammars are compiled over: the tokenizer's (its largest id + 1, at least its length and past every
    stop id), at most ``vocab_size`` (the logits width).

    A checkpoint may pad its logits past the tokenizer (Qwen2.5-VL: 151936 logits, 151665 ids). xgrammar treats
    every such id as a special token that no grammar allows and walks the whole list of them in every bitmask fill
    and every accepted token: with the 3B preset's offline tokenizer (543 ids, 151936 logits) that was 170 us a fill
    inside a JSON string and 24 us an accept, against 1 us each over its own ids. :class:`GrammarMasker` masks the
    ids past this size on the device instead, so constrained rows allow exactly the same tokens.
    """
    ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    return min(vocab_size, max(ids, len(tokenizer), max(stop_token_ids, default=-1) + 1))


class Constraint:
    """One request's grammar state: the compilation future, then its ``xgrammar.GrammarMatcher``.

    Call :meth:`start` once :meth:`ready`; afterwards :meth:`accept` every output token in order (prefill's first
    token included; a batch of requests' tokens at once with :func:`accept_tokens`) and mask the logits with
    :class:`GrammarMasker` before sampling the next one.
    """

    def __init__(self, future: Future):
        self._future = future
        self.matcher = None
        self.vocab_size = 0  # once started: the ids the grammar masks (the rest of the logits' ids never allowed)

    def ready(self) -> bool:
        """Whether compilation has finished (successfully or not)."""
        return self._future.done()

    def start(self) -> str | None:
        """Create the matcher (call once :meth:`ready`); returns an error message when compilation failed."""
        import xgrammar as xgr

        try:
            compiled = self._future.result()
            self.matcher = xgr.GrammarMatcher(compiled)
            self.vocab_size = compiled.tokenizer_info.vocab_size
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


def accept_tokens(constraints: list[Constraint], tokens: list[int]) -> list[bool]:
    """Advance each started constraint's matcher over its token, in one xgrammar call (``BatchGrammarMatcher.
    batch_accept_token``); per row, False when the grammar does not allow the token (that matcher is unchanged).
    Each constraint at most once."""
    if not constraints:
        return []
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher.batch_accept_token([c.matcher for c in constraints], tokens)


class GrammarMasker:
    """Masks a batch's logits with its constrained rows' token bitmasks: one server's reusable host buffer and
    xgrammar batched matchers (one per scheduler; not thread-safe).

    Per call: every live matcher's bitmask row is filled in one ``BatchGrammarMatcher`` call (on the calling
    thread: see :data:`_FILL_THREADS`), the unconstrained rows' are set to all-allowed, and the whole buffer reaches
    the device in one asynchronous copy (from pinned memory on CUDA), where xgrammar's kernel applies it to every
    row.

    Args:
        device: where the logits live.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._filler = None  # xgrammar.BatchGrammarMatcher, made on first use (xgrammar is imported lazily)
        self._host: torch.Tensor | None = None  # int32: the bitmask rows, then (padded logits) one flag per row
        # CUDA: recorded after the last copy out of ``_host``; the buffer is refilled only once it has passed.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def mask(self, logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
        """``logits`` ``[B, V]`` (float32 on the CPU) with the tokens each row's grammar forbids set to ``-inf``.

        Rows whose entry is None (unconstrained requests) or whose matcher is absent or has ended are left as they
        are. A matcher that appears in several rows (``n > 1`` first tokens) is filled once. Returns ``logits``
        itself when no row is constrained (no work), else a new tensor: the raw logits stay intact for
        log-probabilities, and a CUDA graph's output buffer is never written. Makes no blocking host-device copy
        (the decode step's forward may still be running); waits only, if ever, for this masker's previous copy.

        Raises:
            ValueError: the live constraints were compiled over different vocabularies (different compilers).
        """
        live = [i for i, c in enumerate(constraints) if c is not None and c.matcher is not None and not c.terminated]
        if not live:
            return logits
        import xgrammar as xgr

        B, V = logits.shape
        sizes = {constraints[i].vocab_size for i in live}
        if len(sizes) != 1:
            raise ValueError(f"constraints of one batch compiled over different vocabularies: {sorted(sizes)}")
        T = sizes.pop()
        W = xgr.get_bitmask_shape(B, T)[1]
        padded = T < V
        n = B * W + (B if padded else 0)
        host = self._buffer(n)
        bitmask = host[:B * W].view(B, W)
        rows, matchers, copies, seen = [], [], [], {}
        for i in live:
            m = constraints[i].matcher
            if id(m) in seen:
                copies.append((i, seen[id(m)]))
            else:
                seen[id(m)] = i
                rows.append(i)
                matchers.append(m)
        if self._filler is None:
            self._filler = xgr.BatchGrammarMatcher(max_threads=_FILL_THREADS)
        self._filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for i, j in copies:
            bitmask[i] = bitmask[j]
        if len(live) < B:  # unconstrained rows: every token allowed (no ``indices`` for xgrammar's apply, below)
            free = torch.ones(B, dtype=torch.bool)
            free[live] = False
            bitmask[free] = -1
        if padded:
            flags = host[B * W:n]
            flags.zero_()
            flags[live] = 1
        dev = self._upload(host[:n])
        out = logits.clone()
        # Every row, no ``indices``: xgrammar copies a list of indices to the GPU with a blocking copy, which waits
        # for the whole stream (the step's forward included) and so took the overlap scheduler's lead away.
        xgr.apply_token_bitmask_inplace(out, dev[:B * W].view(B, W), vocab_size=T)
        if padded:  # the ids past the tokenizer: never allowed in a constrained row (see grammar_vocab_size)
            out[:, T:].masked_fill_(dev[B * W:n].view(B, 1) != 0, float("-inf"))
        return out

    def _buffer(self, n: int) -> torch.Tensor:
        """The host buffer, at least ``n`` int32 long, once the device has read its previous contents."""
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the decode loop has read the step's tokens since
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * self._host.numel() if self._host is not None else 0),
                                     dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._host

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a slice of the buffer) on the device: on CUDA one asynchronous copy, and the event that lets
        :meth:`_buffer` reuse the buffer after it; on the CPU the buffer itself (read before the next fill)."""
        if self._copied is None:
            return host
        dev = host.to(self.device, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))
        return dev


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """``logits`` ``[B, V]`` masked by each row's grammar through a :class:`GrammarMasker` for this call alone
    (prefill's first tokens; decode keeps one masker for every step); ``logits`` itself, with no masker made, when
    no row has a grammar."""
    if all(c is None for c in constraints):
        return logits
    return GrammarMasker(logits.device).mask(logits, constraints)


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
