"""The gateway's streaming detokenizer: its deltas concatenate to decode(ids, skip_special_tokens=True), cut before
the first stop string, and each token costs a bounded amount of decoding work."""

import random

import pytest
from transformers import AutoTokenizer

from epdserve.frontend.detokenizer import IncrementalDetokenizer, special_ids


@pytest.fixture(scope="module", params=["auto", "processor"])
def tokenizer(request, tiny_model_path):
    """The tiny checkpoint's tokenizer, as ``AutoTokenizer`` loads it and as the gateway gets it (processor)."""
    if request.param == "auto":
        return AutoTokenizer.from_pretrained(tiny_model_path)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path).tokenizer


def _byte_ids(tok) -> dict[int, int]:
    """Byte value -> id of the byte-level BPE token for that single byte (GPT-2's byte-to-unicode map)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {b: tok.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}


def _stream(tok, ids, stop, skip_ids=None):
    """Feed ``ids`` one by one; return (text, stop hit, tokens consumed, deltas)."""
    d = IncrementalDetokenizer(tok, stop, skip_ids)
    parts = []
    for n, t in enumerate(ids, 1):
        delta, hit = d.add(t)
        parts.append(delta)
        if hit:
            return "".join(parts), True, n, parts
    delta, hit = d.flush()
    parts.append(delta)
    return "".join(parts), hit, len(ids), parts


def _random_ids(tok, rng, n):
    """Random ids as random models emit: any id (special tokens included), lone bytes (incomplete and invalid
    UTF-8), and byte runs that form multi-byte characters, interleaved."""
    byte_ids = _byte_ids(tok)
    chars = "é猫☕😀—\ufffd"
    ids = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.4:
            ids.append(rng.randrange(len(tok)))
        elif r < 0.6:
            ids.append(byte_ids[rng.randrange(256)])
        elif r < 0.7:
            ids.append(rng.choice(sorted(special_ids(tok))))
        else:
            ids.extend(byte_ids[b] for b in rng.choice(chars).encode())
    return ids[:n]


def test_special_ids_are_what_decode_skips(tokenizer):
    skip = special_ids(tokenizer)
    assert skip == set(tokenizer.all_special_ids)
    assert all(tokenizer.decode([i], skip_special_tokens=True) == "" for i in skip)
    assert all(tokenizer.decode([i], skip_special_tokens=True) != "" for i in range(len(tokenizer)) if i not in skip)


def test_deltas_concatenate_to_full_decode(tokenizer):
    text_ids = tokenizer("Describe the cat — café ☕ naïve 猫", add_special_tokens=False)["input_ids"]
    for seed in range(300):
        rng = random.Random(seed)
        ids = _random_ids(tokenizer, rng, rng.randrange(1, 60)) + text_ids
        rng.shuffle(ids)
        text, hit, n, _ = _stream(tokenizer, ids, [])
        assert not hit and n == len(ids)
        assert text == tokenizer.decode(ids, skip_special_tokens=True), seed


def test_stop_string_cuts_and_is_not_streamed(tokenizer):
    ids = tokenizer("the cup is blue. the table", add_special_tokens=False)["input_ids"]
    text, hit, n, _ = _stream(tokenizer, ids, ["blue"])
    assert hit and text == "the cup is "
    assert tokenizer.decode(ids[:n]).endswith("blue") and "blue" not in tokenizer.decode(ids[:n - 1])
    text, hit, n, _ = _stream(tokenizer, ids, ["green"])
    assert not hit and n == len(ids) and text == "the cup is blue. the table"


def test_stop_strings_on_random_ids(tokenizer):
    """Stop strings taken from the text itself: the output is decode(consumed ids) cut before the first stop, and
    the consumed ids end with the token that completed the stop string."""
    hits = 0
    for seed in range(300):
        rng = random.Random(1000 + seed)
        ids = _random_ids(tokenizer, rng, rng.randrange(5, 60))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(1, 3)):
            i = rng.randrange(len(full) or 1)
            s = full[i:i + rng.randrange(1, 4)].replace("\ufffd", "")
            stops.append(s or "zz")
        if rng.random() < 0.2:
            stops.append("never-in-the-text")
        text, hit, n, _ = _stream(tokenizer, ids, stops)
        seen = tokenizer.decode(ids[:n], skip_special_tokens=True)
        cuts = [i for i in (seen.find(s) for s in stops) if i >= 0]
        assert text == (seen[:min(cuts)] if cuts else seen), (seed, stops)
        assert hit == bool(cuts)
        if hit:
            hits += 1
            before = tokenizer.decode(ids[:n - 1], skip_special_tokens=True)
            assert not any(s in before for s in stops), (seed, stops)
        else:
            assert n == len(ids)
    assert hits > 200  # the stop strings come from the text: most runs must stop


def test_text_streams_without_delay(tokenizer):
    """Without stop strings each token's text comes out with that token, and a multi-byte character with its last
    byte (nothing is held back needlessly)."""
    ids = tokenizer("the cup is blue. the table", add_special_tokens=False)["input_ids"]
    _, _, _, deltas = _stream(tokenizer, ids, [])
    assert deltas == [tokenizer.decode([i]) for i in ids] + [""]
    byte_ids = _byte_ids(tokenizer)
    _, _, _, deltas = _stream(tokenizer, [byte_ids[b] for b in "猫!".encode()], [])
    assert deltas == ["", "", "猫", "!", ""]


class _CountingTokenizer:
    """Wraps a tokenizer and counts the ids/tokens each call converts; only the calls listed here exist."""

    def __init__(self, tok):
        self._tok = tok
        self.added_tokens_decoder = tok.added_tokens_decoder
        self.backend_tokenizer = tok.backend_tokenizer
        self.work = 0

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        self.work += 1 if isinstance(ids, int) else len(ids)
        return self._tok.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens):
        self.work += len(tokens)
        return self._tok.convert_tokens_to_string(tokens)

    def decode(self, ids, skip_special_tokens=False):
        self.work += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["random", "text", "replacement_char", "invalid_bytes", "cjk_bytes"])
def test_work_per_token_is_bounded(tokenizer, kind):
    """Per added token, the ids and tokens converted stay below a constant over 500 tokens (O(1), not O(n)),
    also while the text keeps ending in U+FFFD (the character itself, or invalid bytes)."""
    byte_ids = _byte_ids(tokenizer)
    rng = random.Random(7)
    if kind == "random":
        ids = _random_ids(tokenizer, rng, 500)
    elif kind == "text":
        ids = (tokenizer("The photo shows a cat sitting on a table next to a cup of coffee. ",
                         add_special_tokens=False)["input_ids"] * 40)[:500]
    elif kind == "replacement_char":  # a model repeating U+FFFD (bytes EF BF BD)
        ids = [byte_ids[b] for b in "\ufffd".encode()] * 167
    elif kind == "invalid_bytes":  # lone continuation bytes and lead bytes with nothing after them
        ids = [byte_ids[rng.choice([0x80, 0xBF, 0xE4, 0xF0])] for _ in range(500)]
    else:
        ids = [byte_ids[b] for b in ("猫咖啡" * 60).encode()][:500]
    counting = _CountingTokenizer(tokenizer)
    d = IncrementalDetokenizer(counting, ["never-in-the-text"], special_ids(tokenizer))
    parts, per_token = [], []
    for t in ids:
        before = counting.work
        parts.append(d.add(t)[0])
        per_token.append(counting.work - before)
    parts.append(d.flush()[0])
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(per_token) <= 16, (kind, max(per_token), per_token.index(max(per_token)))


def test_context_dependent_decoder():
    """A SentencePiece-style (Metaspace) tokenizer, whose decoder drops the first token's leading space: its text
    depends on the neighbours, which the window's left context (vLLM's prefix offset) takes care of."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.train_from_iterator(["the cat sat on the mat. a cup of coffee, naïve café 猫 on the table"] * 4,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                    show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert not IncrementalDetokenizer(tok, []).byte_level
    ids = tok("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    assert _stream(tok, ids, [])[3][:2] == ["the", " cat"]
    for seed in range(200):
        rng = random.Random(seed)
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert _stream(tok, ids, [])[0] == tok.decode(ids, skip_special_tokens=True), seed
