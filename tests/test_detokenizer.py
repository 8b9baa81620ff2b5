"""Streaming text deltas: their concatenation equals decode(ids, skip_special_tokens=True), stop strings cut."""

import random

import pytest
from transformers import AutoTokenizer

from epdserve.decode.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _stream(tok, ids, stop):
    d = IncrementalDetokenizer(tok, stop)
    parts = []
    for i, t in enumerate(ids):
        delta, hit = d.add(t, final=i == len(ids) - 1)
        parts.append(delta)
        if hit:
            return "".join(parts), True
    return "".join(parts), False


def test_deltas_concatenate_to_full_decode(tokenizer):
    rng = random.Random(0)
    text_ids = tokenizer("Describe the cat — café ☕ naïve 猫", add_special_tokens=False)["input_ids"]
    for _ in range(30):
        # Random ids include special tokens and lone bytes (incomplete UTF-8), as random models emit.
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] + text_ids
        rng.shuffle(ids)
        text, _ = _stream(tokenizer, ids, [])
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_and_is_not_streamed(tokenizer):
    ids = tokenizer("the cup is blue. the table", add_special_tokens=False)["input_ids"]
    text, hit = _stream(tokenizer, ids, ["blue"])
    assert hit and text == "the cup is "
    text, hit = _stream(tokenizer, ids, ["green"])
    assert not hit and text == "the cup is blue. the table"
