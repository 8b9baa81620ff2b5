"""The batched grammar step (issue 46): :class:`~epdserve.engine.grammar.GrammarMasker` fills every constrained
row's bitmask in one xgrammar call over the tokenizer's own ids and masks the ids a checkpoint pads its logits with
on the device; :func:`~epdserve.engine.grammar.accept_tokens` advances every matcher in one call. Both must do
exactly what the per-row path did: the reference here is xgrammar's own ``GrammarMatcher`` compiled over the padded
vocabulary (the earlier ``TokenizerInfo``), filled and advanced one row at a time."""

from __future__ import annotations

import json
import random

import pytest
import torch

SCHEMA = {"type": "object", "properties": {
    "caption": {"type": "string"},
    "objects": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "count": {"type": "integer"}}, "required": ["name", "count"]}},
    "outdoor": {"type": "boolean"}}, "required": ["caption", "objects", "outdoor"]}
PAD = 77  # logits past the tokenizer, as in a checkpoint with padded embeddings
ROWS = 40  # a 40-row decode batch


def _doc(i: int) -> str:
    """A document of SCHEMA (compact, as the grammar wants it)."""
    return json.dumps({"caption": f"a photo, number {i}", "objects": [{"name": "dog", "count": i},
                                                                        {"name": "ball", "count": 3}],
                       "outdoor": i % 2 == 0}, separators=(", ", ": "))


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    """(tokenizer, padded logits width, stop ids, GrammarCompiler over that width, reference compiled grammar)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from epdserve.engine.grammar import GrammarCompiler
    from epdserve.engine.grammar_build import build_grammar
    from epdserve.models.config import ModelConfig
    from epdserve.wire.messages import GrammarSpec

    cfg = ModelConfig.load(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    vocab, stop = cfg.vocab_size + PAD, list(cfg.eos_token_ids)
    grammars = GrammarCompiler(tiny_model_path, vocab, stop)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=stop)
    reference = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        build_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA))))
    yield tok, vocab, stop, grammars, reference
    grammars.close()


def _pairs(setup, n: int, seed: int):
    """``n`` (started Constraint, reference GrammarMatcher, next token of its document) in the same states: each
    has taken a different prefix of its document (inside strings, between properties, in the array, ...)."""
    import xgrammar as xgr

    from epdserve.engine.grammar import constraint_for
    from epdserve.wire.messages import GrammarSpec

    tok, _, _, grammars, reference = setup
    rng, out = random.Random(seed), []
    for i in range(n):
        ids = tok.encode(_doc(i), add_special_tokens=False)
        k = rng.randrange(0, len(ids))
        c = constraint_for(grammars, GrammarSpec("json_schema", json.dumps(SCHEMA)))
        c._future.result(timeout=60)
        assert c.start() is None
        ref = xgr.GrammarMatcher(reference)
        for t in ids[:k]:
            assert c.accept(t) and ref.accept_token(t)
        out.append((c, ref, ids[k]))
    return out


def _reference_mask(logits: torch.Tensor, refs: list) -> torch.Tensor:
    """``logits`` masked the per-row way: each reference matcher fills its own row of a bitmask over the padded
    vocabulary (None rows stay all-allowed)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(*logits.shape)
    for i, m in enumerate(refs):
        if m is not None:
            m.fill_next_token_bitmask(bitmask, i)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask)
    return out


def test_grammar_vocab_is_the_tokenizers_ids(setup):
    from epdserve.engine.grammar import grammar_vocab_size

    tok, vocab, stop, _, _ = setup
    assert grammar_vocab_size(tok, vocab, stop) == len(tok) < vocab
    assert grammar_vocab_size(tok, vocab, [len(tok) + 5]) == len(tok) + 6  # a stop id past the tokenizer
    assert grammar_vocab_size(tok, len(tok) - 3, stop) == len(tok) - 3  # never past the logits


def test_batched_masks_equal_per_row_matchers_across_steps(setup):
    """Constrained rows in many states, unconstrained rows, an ended matcher and a matcher shared by two rows (the
    first tokens of n > 1) give exactly the per-row masks, the padded ids included; a second step through the same
    masker (its buffer reused, rows turned unconstrained) leaves nothing of the first behind."""
    from epdserve.engine.grammar import GrammarMasker, accept_tokens

    tok, vocab, stop, _, _ = setup
    pairs = _pairs(setup, ROWS, seed=1)
    ended, ended_ref = _fresh(setup)  # a grammar run to its end: masks nothing, like an unconstrained row
    for t in tok.encode(_doc(ROWS), add_special_tokens=False) + [stop[0]]:
        assert ended.accept(t) and ended_ref.accept_token(t)
    assert ended.terminated
    cons = [c for c, _, _ in pairs]
    refs = [r for _, r, _ in pairs]
    # rows: None, every constraint, None between, the ended one, a shared matcher twice.
    rows = [None] + cons[:20] + [None, ended] + cons[20:] + [cons[3]]
    ref_rows = [None] + refs[:20] + [None, None] + refs[20:] + [refs[3]]
    logits = torch.randn(len(rows), vocab)
    logits[:, len(tok):] = 50.0  # a padded id left unmasked would win every argmax
    raw = logits.clone()
    masker = GrammarMasker(torch.device("cpu"))
    masked = masker.mask(logits, rows)
    expect = _reference_mask(logits, ref_rows)
    assert torch.equal(masked, expect)
    for i, c in enumerate(rows):
        allowed = torch.isfinite(masked[i])
        if c is None or c.terminated:
            assert allowed.all() and torch.equal(masked[i], logits[i])
        else:
            assert 0 < int(allowed.sum()) < len(tok) and not allowed[len(tok):].any()
    assert torch.equal(logits, raw)  # the raw logits (log-probabilities, a CUDA graph's output) are not written

    # Step 2: every constrained row takes its document's next token in one call, the first half of the rows turn
    # unconstrained (their buffer rows held masks a moment ago) and the order changes.
    nxt = [t for _, _, t in pairs]
    assert accept_tokens(cons, nxt) == [True] * len(cons)
    for r, t in zip(refs, nxt):
        assert r.accept_token(t)
    rows2 = [None] * 22 + cons[21:][::-1]
    ref_rows2 = [None] * 22 + refs[21:][::-1]
    logits2 = torch.randn(len(rows2), vocab)
    logits2[:, len(tok):] = 50.0
    assert torch.equal(masker.mask(logits2, rows2), _reference_mask(logits2, ref_rows2))


def _fresh(setup):
    """A started Constraint and a reference matcher, both at the grammar's start."""
    import xgrammar as xgr

    from epdserve.engine.grammar import constraint_for
    from epdserve.wire.messages import GrammarSpec

    _, _, _, grammars, reference = setup
    c = constraint_for(grammars, GrammarSpec("json_schema", json.dumps(SCHEMA)))
    c._future.result(timeout=60)
    assert c.start() is None
    return c, xgr.GrammarMatcher(reference)


def test_batched_accept_leaves_each_matcher_where_per_row_accepts_would(setup):
    """One call over matchers in different states: allowed tokens advance theirs, a forbidden token is refused and
    leaves its matcher as it was, a stop token at the document's end ends its grammar; each matcher then masks as
    its per-row twin (advanced one token at a time) does."""
    import xgrammar as xgr

    from epdserve.engine.grammar import accept_tokens, GrammarMasker

    tok, vocab, stop, _, _ = setup
    pairs = _pairs(setup, 12, seed=2)
    cons, refs, toks = [c for c, _, _ in pairs], [r for _, r, _ in pairs], [t for _, _, t in pairs]
    done, done_ref = _fresh(setup)
    ids = tok.encode(_doc(7), add_special_tokens=False)
    for t in ids:
        assert done.accept(t) and done_ref.accept_token(t)
    bad, bad_ref = _fresh(setup)  # at the start only "{" is allowed
    forbidden = tok.encode("x", add_special_tokens=False)[0]
    cons, refs, toks = cons + [done, bad], refs + [done_ref, bad_ref], toks + [stop[0], forbidden]
    got = accept_tokens(cons, toks)
    want = [r.accept_token(t) for r, t in zip(refs, toks)]
    assert got == want and got[-2] is True and got[-1] is False
    assert done.terminated and done_ref.is_terminated() and not bad.terminated
    live = [c for c in cons if not c.terminated]
    live_refs = [r for r in refs if not r.is_terminated()]
    logits = torch.randn(len(live), vocab)
    assert torch.equal(GrammarMasker(torch.device("cpu")).mask(logits, live), _reference_mask(logits, live_refs))
    assert xgr.BatchGrammarMatcher.batch_accept_token([], []) == [] and accept_tokens([], []) == []


def test_forks_start_from_the_grammar_start_and_mask_like_a_fresh_matcher(setup):
    """``Constraint.fork`` (n > 1 at decode) gives a started matcher of the same grammar, independent of the one it
    was forked from, with the same vocabulary size the masker reads."""
    from epdserve.engine.grammar import GrammarMasker

    tok, vocab, _, _, _ = setup
    (c, ref, t), = _pairs(setup, 1, seed=3)
    f = c.fork()
    _, start_ref = _fresh(setup)
    assert f.matcher is not c.matcher and f.vocab_size == c.vocab_size == len(tok)
    logits = torch.randn(2, vocab)
    assert torch.equal(GrammarMasker(torch.device("cpu")).mask(logits, [c, f]), _reference_mask(logits, [ref, start_ref]))
