"""Structured outputs (issue 28): JSON schemas, regexes, choices, EBNF and ``json_object`` through every protocol,
end to end through ``epdserve launch`` of the tiny readable checkpoint (the default model's kind: random weights,
so any valid output is the grammar's doing), and the engine pieces on their own.

Every schema is generated here with bounded strings, arrays and numbers, so a valid output fits ``max_tokens``;
outputs must then finish with ``stop`` and validate. Requests run concurrently: batches mix constrained and
unconstrained rows, and the unconstrained ones must still equal their answers alone.
"""

from __future__ import annotations

import base64
import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field

from conftest import launched

MAX_TOKENS = 200  # far above what the bounded schemas need (about 60 tokens at most)


@pytest.fixture(scope="module")
def structured_server(tmp_path_factory):
    """One launch for the module: (base URL, model name)."""
    from epdserve.models.tiny import make_tiny_model

    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny-readable"), readable=True))
    with launched(model, tmp_path_factory.mktemp("launch-structured")) as (url, _):
        yield url, model


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _image_message(path, text: str) -> dict:
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["int", "number", "bool", "enum", "pattern", "string"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 50), 2)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "a b", 'q"t'], rng.randint(1, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^\d{3}-\d{2}$", r"^(yes|no)$"])}
    return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 6)}


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: 1-4 properties (leaves, arrays of leaves with min/max items, nested objects), some
    required, the rest optional."""
    props = {}
    for i in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            props[f"o{i}"] = _schema(rng, depth + 1)
        elif roll < 0.4:
            lo = rng.randint(0, 2)
            props[f"a{i}"] = {"type": "array", "items": _leaf(rng), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
        else:
            props[f"f{i}"] = _leaf(rng)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required}


def _stream_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_generated_json_schemas_validate_greedy_and_sampled_streamed_and_not(structured_server, photo_paths):
    url, model = structured_server
    client = _client(url)
    rng = random.Random(28)
    schemas = [_schema(rng) for _ in range(20)]
    photo = photo_paths["chelsea"]

    def constrained(job):
        i, schema, sampled = job
        messages = [_image_message(photo, "Fill the form.") if i % 4 == 0 else
                    {"role": "user", "content": f"Form {i}, as JSON."}]
        kw = dict(model=model, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=1.0 if sampled else 0,
                  seed=1000 + i if sampled else None,
                  response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                          "strict": True}})
        if sampled:  # sampled requests stream, greedy ones do not
            return _stream_text(client.chat.completions.create(stream=True, **kw))
        out = client.chat.completions.create(**kw)
        return out.choices[0].message.content, out.choices[0].finish_reason

    def plain(i):
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"plain {i}"}],
                                             max_completion_tokens=12, temperature=0)
        return out.choices[0].message.content

    jobs = [(i, s, sampled) for i, s in enumerate(schemas) for sampled in (False, True)]
    alone = [plain(i) for i in range(3)]
    with ThreadPoolExecutor(12) as pool:
        mixed = [pool.submit(plain, i) for i in range(3)]
        results = list(pool.map(constrained, jobs))
        mixed = [f.result() for f in mixed]
    assert mixed == alone  # unconstrained rows of mixed batches are untouched
    for (i, schema, sampled), (text, finish) in zip(jobs, results):
        assert finish == "stop", (i, sampled, text)
        jsonschema.validate(json.loads(text), schema)
    assert len({text for text, _ in results}) > 10  # the schemas differ, so do the answers
    # A seeded sampled request is reproducible whatever it was batched with.
    again = constrained(jobs[1])
    assert again == results[1]


class Item(BaseModel):
    name: str = Field(max_length=6)
    quantity: int = Field(ge=1, le=9)


class Invoice(BaseModel):
    currency: Literal["EUR", "USD"]
    total: int = Field(ge=0, le=999)
    items: list[Item] = Field(min_length=1, max_length=2)
    paid: bool


def test_openai_parse_with_a_pydantic_model_and_an_image(structured_server, photo_paths):
    url, model = structured_server
    client = _client(url)
    for seed in (None, 7):
        out = client.chat.completions.parse(
            model=model, messages=[_image_message(photo_paths["page"], "Read the invoice.")],
            response_format=Invoice, max_completion_tokens=MAX_TOKENS, temperature=0 if seed is None else 1.0,
            seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Invoice)
        assert 1 <= len(choice.message.parsed.items) <= 2


REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[A-Z][a-z]{2,5}( [A-Z][a-z]{2,5})?", r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)"]


def test_regex_choice_ebnf_and_json_object_through_every_protocol(structured_server):
    url, model = structured_server
    msgs = [{"role": "user", "content": "Answer."}]

    def post(path, body):
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def run(job):
        kind, arg, temp = job
        sp = {"max_new_tokens": 60, "temperature": temp, "sampling_seed": 5}
        if kind == "generate":  # SGLang
            out = post("/generate", {"text": "Answer:", "sampling_params": {**sp, "regex": arg}})
            return out["text"], out["meta_info"]["finish_reason"]["type"]
        if kind == "completions":  # vLLM's structured_outputs on the legacy API
            out = post("/v1/completions", {"model": model, "prompt": "Answer:", "max_tokens": 60, "temperature": temp,
                                           "seed": 5, "structured_outputs": arg})
        else:
            out = post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 60,
                                                "temperature": temp, "seed": 5, **arg})
        c = out["choices"][0]
        return c.get("text", c.get("message", {}).get("content")), c["finish_reason"]

    jobs = [("generate", rx, t) for rx in REGEXES for t in (0, 1.0)]
    jobs += [("completions", {"regex": rx}, 1.0) for rx in REGEXES[:2]]
    jobs += [("completions", {"choice": ["yes", 'no "way"', "ümlaut"]}, t) for t in (0, 1.0)]
    jobs += [("chat", {"structured_outputs": {"grammar": 'root ::= "(" [0-9]+ (" + " [0-9]+)? ")"'}}, 1.0),
             # Any JSON object: sampled from random weights it may never close, so greedy (it gives "{}").
             ("chat", {"response_format": {"type": "json_object"}}, 0),
             ("chat", {"structured_outputs": {"json_object": True}}, 0),
             ("generate_json", None, 1.0)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, [j for j in jobs if j[0] != "generate_json"]))
    for (kind, arg, _), (text, finish) in zip(jobs, results):
        assert finish == "stop", (kind, arg, text)
        if kind == "generate":
            assert re.fullmatch(arg, text), (arg, text)
        elif "regex" in arg:
            assert re.fullmatch(arg["regex"], text), (arg, text)
        elif "choice" in arg:
            assert text in arg["choice"]
        elif "grammar" in arg.get("structured_outputs", {}):
            assert re.fullmatch(r"\(\d+( \+ \d+)?\)", text), text
        else:
            assert isinstance(json.loads(text), dict), text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}}, "required": ["n"]}
    out = post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 30, "json_schema": json.dumps(schema)}})
    jsonschema.validate(json.loads(out["text"]), schema)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "Unsupported type"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing_defined"}}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "only one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]


def test_bad_grammars_get_400_with_the_library_message_and_the_server_keeps_serving(structured_server):
    url, model = structured_server
    msgs = [{"role": "user", "content": "hi"}]
    for extra, word in BAD:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": msgs, **extra}, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (extra, r.text)
    r = httpx.post(f"{url}/generate", json={"text": "x", "sampling_params": {"json_schema": "{not json"}}, timeout=60)
    assert r.status_code == 400 and "JSON" in r.text, r.text
    r = httpx.post(f"{url}/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}},
                   timeout=60)
    assert r.status_code == 400 and "only one" in r.text, r.text
    ok = _client(url).chat.completions.create(model=model, messages=msgs, max_completion_tokens=20, temperature=0,
                                              extra_body={"structured_outputs": {"regex": "(ab){2}"}})
    assert ok.choices[0].message.content == "abab" and ok.choices[0].finish_reason == "stop"


# ---- the engine's pieces on their own ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(tiny_model_path):
    from epdserve.engine.grammar import GrammarCompiler
    from epdserve.models.config import ModelConfig

    cfg = ModelConfig.load(tiny_model_path)
    c = GrammarCompiler(tiny_model_path, cfg.vocab_size, list(cfg.eos_token_ids))
    yield c, cfg.vocab_size
    c.close()


def test_mask_logits_masks_constrained_rows_only_and_rejected_grammars_fail_their_request(compiler):
    from epdserve.engine.grammar import constraint_for, mask_logits
    from epdserve.wire.messages import GrammarSpec

    grammars, vocab = compiler
    first = grammars.compile(GrammarSpec("regex", "7+"))
    assert grammars.compile(GrammarSpec("regex", "7+")) is first  # cached by kind and text
    c = constraint_for(grammars, GrammarSpec("regex", "7+"))
    first.result(timeout=60)
    assert c.ready() and c.start() is None
    logits = torch.randn(3, vocab)
    assert mask_logits(logits, [None, None, None]) is logits
    masked = mask_logits(logits, [None, c, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and len(allowed) < vocab // 4
    tok = int(masked[1].argmax())
    assert tok in allowed and c.accept(tok) and not c.terminated
    # No per-row indices reach xgrammar: on CUDA it copies a list of them with a blocking copy (a stall of the
    # overlap scheduler); the unconstrained rows' bitmask rows allow every token instead.
    import xgrammar as xgr

    calls = []
    real = xgr.apply_token_bitmask_inplace
    xgr.apply_token_bitmask_inplace = lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1]
    try:
        again = mask_logits(logits, [None, c, None])
    finally:
        xgr.apply_token_bitmask_inplace = real
    assert calls and all(kw.get("indices") is None for kw in calls)
    assert torch.equal(again[0], logits[0]) and torch.equal(again[2], logits[2])
    # A grammar xgrammar rejects (one the gateway would have refused) fails its request, not the compiler.
    bad = constraint_for(grammars, GrammarSpec("regex", "(unclosed"))
    while not bad.ready():
        pass
    assert "grammar rejected" in bad.start()
    assert "not enabled" in constraint_for(None, GrammarSpec("regex", "a")).start()
    ok = constraint_for(grammars, GrammarSpec("json_object"))
    ok._future.result(timeout=60)
    assert ok.start() is None


@pytest.mark.parametrize("model", ["tiny_model_path", "tiny_qwen3_5_path"])
def test_schedulers_carry_the_grammar_from_prefill_to_decode_and_fail_only_bad_requests(request, model):
    """Prefill masks the first token, decode's matcher accepts it and masks the rest, in a batch with an
    unconstrained request, each step's forward launched ahead of the host's mask filling; a first token the grammar
    forbids, or a grammar that does not compile (sent past the gateway), fails that request only, and every KV page
    (and, for the hybrid Qwen3.5, every state slot) comes back."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from epdserve.decode.scheduler import DecodeScheduler
    from epdserve.engine.model_runner import ModelRunner
    from epdserve.prefill.scheduler import PrefillScheduler
    from epdserve.wire.messages import DecodeRequest, GrammarSpec, KVRegister, PrefillRequest, SamplingParams

    from epdserve.engine.grammar import GrammarCompiler

    tiny_model_path = request.getfixturevalue(model)
    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=4)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tok.encode("The number is")
    grammars = GrammarCompiler(tiny_model_path, runner.config.vocab_size, list(runner.config.eos_token_ids))
    request.addfinalizer(grammars.close)
    prefill = PrefillScheduler(runner, context_length=4096, max_prefill_tokens=4096, timeout_s=30, grammars=grammars)
    decode = DecodeScheduler(runner, context_length=4096, max_running_requests=8, timeout_s=30, kv_endpoint="tcp://d",
                             grammars=grammars)
    regex = GrammarSpec("regex", "[0-9]{2,4}x")
    cases = {"re": regex, "plain": None, "bad": GrammarSpec("regex", "(open"), "other": regex}
    for room, (rid, grammar) in enumerate(cases.items()):
        sp = SamplingParams(temperature=0, max_new_tokens=12, grammar=grammar)
        prefill.add_request(PrefillRequest(rid=rid, input_ids=prompt, images=[], sampling=sp, bootstrap_room=room))
        prefill.register(KVRegister(rid=rid, bootstrap_room=room, kv_endpoint="tcp://d"))
        # "other" decodes under a grammar its first token (sampled under the regex) cannot start.
        dsp = replace(sp, grammar=GrammarSpec("regex", "[a-z]+")) if rid == "other" else sp
        decode.add_request(DecodeRequest(rid=rid, prompt_len=len(prompt), sampling=dsp, bootstrap_host="h",
                                         bootstrap_port=1, bootstrap_room=room), peer=b"g")
    transfers = {}
    for _ in range(200):
        transfers.update((t.rid, t) for _, t in prefill.step())
        if len(transfers) == len(cases):
            break
        time.sleep(0.01)  # compiling on the worker thread
    assert "grammar rejected" in transfers["bad"].error and transfers["re"].error is None
    assert prefill.pool.num_free + prefill.radix.num_pages == prefill.pool.num_pages
    for t in transfers.values():
        decode.add_transfer(t)
    outs, ahead = [], 0
    for _ in range(60):
        outs += [o for _, o in decode.step()]
        ahead += decode.ahead is not None  # constrained batches: the next forward already launched
        if not decode.has_work():
            break
        time.sleep(0.005)
    final = {o.rid: o for o in outs if o.finish_reason}
    assert set(final) == set(cases)
    ids = {rid: [t for o in outs if o.rid == rid for t in o.token_ids] for rid in cases}
    assert final["re"].finish_reason == "stop" and re.fullmatch(regex.text, tok.decode(ids["re"],
                                                                                        skip_special_tokens=True))
    assert final["plain"].finish_reason == "length" and len(ids["plain"]) == 12
    assert final["bad"].finish_reason == final["other"].finish_reason == "error"
    assert "not allowed" in final["other"].error
    assert decode.pool.num_free == decode.pool.num_pages and not decode.running
    assert decode.states.used == 0 and prefill.states.used == 0
    # The grammar's host time per step is on /metrics: "re" decoded ~5 constrained steps.
    fills, accepts = (decode.metrics.value(f"epdserve:grammar_{k}_seconds_count", stage="decode")
                      for k in ("fill", "accept"))
    assert 3 <= fills <= 12 and 3 <= accepts <= 12 and ahead >= 3
    assert decode.metrics.value("epdserve:grammar_fill_seconds_sum", stage="decode") > 0
