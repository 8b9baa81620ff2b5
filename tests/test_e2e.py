"""The whole pipeline, as README starts it (`epdserve launch`, four processes), against transformers' generate().

Greedy output through the gateway must equal ``generate(do_sample=False)`` on the same checkpoint and the same
processor output, token for token, and the text must equal ``tokenizer.decode(ids, skip_special_tokens=True)``.
The launched servers (fixture ``server``, shared with test_observability.py) are in conftest.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import hf_reference_model

NEW_TOKENS = 40
PROMPT = "Describe this image in detail, please: the colours, the objects, and what happens in the scene."


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return hf_reference_model(tiny_model_path)


def _data_url(path: Path) -> str:
    mime = "image/jpeg" if path.suffix == ".jpg" else "image/png"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _openai_messages(turns):
    """turns: list of (role, [str | Path]) -> OpenAI messages with image_url parts."""
    out = []
    for role, parts in turns:
        if len(parts) == 1 and isinstance(parts[0], str):
            out.append({"role": role, "content": parts[0]})
            continue
        out.append({"role": role, "content": [
            {"type": "image_url", "image_url": {"url": _data_url(p)}} if isinstance(p, Path)
            else {"type": "text", "text": p} for p in parts]})
    return out


def _hf_inputs(hf, turns):
    """The processor's own output for ``turns`` (chat template, images)."""
    from PIL import Image

    processor, _ = hf
    messages, images = [], []
    for role, parts in turns:
        if len(parts) == 1 and isinstance(parts[0], str):
            messages.append({"role": role, "content": parts[0]})
            continue
        content = []
        for p in parts:
            if isinstance(p, Path):
                images.append(Image.open(p))
                content.append({"type": "image"})
            else:
                content.append({"type": "text", "text": p})
        messages.append({"role": role, "content": content})
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")


def _hf_generate(hf, turns, new_tokens=NEW_TOKENS, logits_processor=None, **gen_kw):
    """transformers' greedy generate() on the processor's own output (EOS ignored, like ignore_eos)."""
    from transformers import GenerationConfig

    inputs = _hf_inputs(hf, turns)
    # eos_token_id=[], not None: None falls back to the checkpoint's generation_config (EOS ids 2 and 0).
    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0, **gen_kw)
    with torch.inference_mode():
        return inputs, hf[1].generate(**inputs, generation_config=gen, logits_processor=logits_processor)


def _hf_reference(hf, turns, new_tokens=NEW_TOKENS):
    """Greedy ids from transformers' generate() on the processor's own output (EOS ignored, like ignore_eos)."""
    inputs, out = _hf_generate(hf, turns, new_tokens)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return inputs["input_ids"][0].tolist(), ids, hf[0].tokenizer.decode(ids, skip_special_tokens=True)


def _chat(url, model, messages, **extra):
    body = {"model": model, "messages": messages, "temperature": 0, "max_completion_tokens": NEW_TOKENS,
            "ignore_eos": True, "return_token_ids": True, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


CASES = {
    "text": [("user", ["Tell me a story about a rocket and a cat."])],
    "one_photo": [("user", ["chelsea", PROMPT])],
    "two_photos": [("user", ["astronaut", "What differs between these two pictures?", "coffee"])],
    "two_turns": [("user", ["rocket", "What is this?"]), ("assistant", ["A rocket launch."]),
                  ("user", ["Where is it going?"])],
}


def _resolve(case, photo_paths):
    return [(role, [photo_paths[p] if p in photo_paths else p for p in parts]) for role, parts in CASES[case]]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(server, hf, tiny_model_path, photo_paths, case):
    url, _ = server
    turns = _resolve(case, photo_paths)
    ref_prompt, ref_ids, ref_text = _hf_reference(hf, turns)
    resp = _chat(url, tiny_model_path, _openai_messages(turns))
    choice = resp["choices"][0]
    assert resp["prompt_token_ids"] == ref_prompt
    assert choice["token_ids"] == ref_ids
    assert choice["message"]["content"] == ref_text
    assert choice["finish_reason"] == "length"
    assert resp["usage"]["completion_tokens"] == NEW_TOKENS
    assert resp["usage"]["prompt_tokens"] == len(ref_prompt)


def test_kv_took_the_shared_path(server):
    """Runs after the parity cases: every one of them had its KV copied out of the mapped prefill pool and
    acknowledged (the prefill server released the pages only then)."""
    _, log_path = server
    # Prefill logs the release when decode's ack arrives, which may come after the answer: wait for it.
    deadline = time.monotonic() + 10
    while (log := log_path.read_text()).count("KV copied by decode, pages released") < len(CASES) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "mapped a prefill KV pool (shm" in log
    assert log.count("KV copied by decode, pages released") >= len(CASES)
    assert "KV transfer has shape" not in log


def test_openai_client_stream_and_not(server, hf, tiny_model_path, photo_paths):
    openai = pytest.importorskip("openai")
    url, _ = server
    turns = _resolve("one_photo", photo_paths)
    _, _, ref_text = _hf_reference(hf, turns)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY")
    kw = dict(model=tiny_model_path, messages=_openai_messages(turns), temperature=0,
              max_completion_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].message.content == ref_text
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS


def test_repeated_photo_hits_radix_and_embedding_caches(server, tiny_model_path, photo_paths):
    url, log_path = server
    turns = [("system", ["You are a careful visual assistant. Answer in one short paragraph."]),
             ("user", [photo_paths["page"], PROMPT])]
    messages = _openai_messages(turns)
    first = _chat(url, tiny_model_path, messages)
    second = _chat(url, tiny_model_path, messages)
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    pad = 5  # <|image_pad|> in the tiny tokenizer
    ids = second["prompt_token_ids"]
    image_end = max(i for i, t in enumerate(ids) if t == pad) + 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end
    # The encoder logs each request's cache hits under the request id.
    deadline = time.monotonic() + 5
    while not re.search(rf"{second['id']}.*1 from cache", log_path.read_text()):
        assert time.monotonic() < deadline, "no encoder cache hit logged for the second request"
        time.sleep(0.1)
    # The gateway sent the photo to the same one of the two encoders both times (content-hash routing).
    routed = [re.findall(rf"rid={r['id']} 1 image\(s\) -> encoder (\S+)", log_path.read_text())
              for r in (first, second)]
    assert len(routed[0]) == 1 and routed[0] == routed[1]


def test_eight_concurrent_requests_match_their_single_outputs(server, tiny_model_path, photo_paths):
    url, _ = server
    names = ["chelsea", "astronaut", "coffee", "rocket", "camera", "page"]
    requests = [_openai_messages([("user", [photo_paths[names[i % 6]], f"Question {i}: what is shown?"])])
                for i in range(6)]
    requests += [_openai_messages([("user", [f"Write {i} words about serving."])]) for i in range(2)]
    single = [_chat(url, tiny_model_path, m)["choices"][0]["token_ids"] for m in requests]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda m: _chat(url, tiny_model_path, m)["choices"][0]["token_ids"], requests))
    assert together == single


def test_bad_input_gets_clear_errors_and_server_keeps_serving(server, tiny_model_path, photo_paths):
    url, _ = server
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not really a png").decode()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": tiny_model_path, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": corrupt}}, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"].lower()
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": tiny_model_path, "messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"].lower()
    ok = _chat(url, tiny_model_path, _openai_messages([("user", [photo_paths["chelsea"], "And now?"])]))
    assert ok["usage"]["completion_tokens"] == NEW_TOKENS


def test_stream_deltas_equal_final_text(server, tiny_model_path, photo_paths):
    url, _ = server
    messages = _openai_messages([("user", [photo_paths["coffee"], "Describe it."])])
    full = _chat(url, tiny_model_path, messages)["choices"][0]["message"]["content"]
    body = {"model": tiny_model_path, "messages": messages, "temperature": 0, "max_completion_tokens": NEW_TOKENS,
            "ignore_eos": True, "stream": True}
    parts = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line[6:])["choices"]:
            parts.append(c["delta"].get("content") or "")
    assert "".join(parts) == full


def test_bench_against_epdserve(server, tiny_model_path, tmp_path):
    from epdserve.bench.cli import main as bench

    url, _ = server
    out = tmp_path / "bench.json"
    code = bench(["--base-url", url, "--model", tiny_model_path, "--dataset", "shared-prefix", "--num-prompts", "6",
                  "--output-len", "8", "--max-concurrency", "3", "--output-json", str(out), "--disable-tqdm"])
    assert code == 0
    doc = json.loads(out.read_text())
    ok = [r for r in doc["requests"] if r["success"]]
    assert len(ok) == 6 and all(r["completion_tokens"] == 8 for r in ok)
    assert any(r["cached_tokens"] > 0 for r in ok)  # the shared prefix hit the radix cache


def test_sampling_parameters(server, hf, tiny_model_path, photo_paths):
    url, log_path = server
    messages = _openai_messages([("user", [photo_paths["astronaut"], "Tell me about her."])])
    sampled = [_chat(url, tiny_model_path, messages, temperature=1.0, top_p=0.9, top_k=50, seed=s)
               for s in (7, 7, 8)]
    ids = [r["choices"][0]["token_ids"] for r in sampled]
    assert ids[0] == ids[1] and ids[0] != ids[2]  # a seed makes sampling reproducible
    greedy_choice = _chat(url, tiny_model_path, messages)["choices"][0]
    greedy = greedy_choice["message"]["content"]
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 3]
    # Room to decode long past the stop string (ignore_eos): the gateway finds it while decode still runs, so the
    # abort below is sent (with the greedy run's 40 tokens decode could finish first: nothing left to abort).
    cut = _chat(url, tiny_model_path, messages, stop=[stop], max_completion_tokens=NEW_TOKENS * 10)
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == greedy[:greedy.index(stop)]
    # The gateway found the stop string: the ids end with the one that completed it, and usage counts only those.
    cut_ids, decode_text = cut["choices"][0]["token_ids"], hf[0].tokenizer.decode
    assert cut_ids == greedy_choice["token_ids"][:len(cut_ids)] and cut["usage"]["completion_tokens"] == len(cut_ids)
    assert stop in decode_text(cut_ids, skip_special_tokens=True)
    assert stop not in decode_text(cut_ids[:-1], skip_special_tokens=True)
    deadline = time.monotonic() + 5  # ... and aborted the request at prefill and decode
    while f"rid={cut['id']} abort" not in log_path.read_text():
        assert time.monotonic() < deadline, "the gateway sent no abort after the stop string"
        time.sleep(0.1)
    body = {"model": tiny_model_path, "messages": messages, "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"


def _sse_events(response) -> list:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def _templated_text_reference(hf, photo_paths):
    """The "text" case's reference ``(prompt ids, greedy ids, text)`` and its chat-templated prompt as a string."""
    turns = _resolve("text", photo_paths)
    text = hf[0].apply_chat_template([{"role": "user", "content": turns[0][1][0]}], add_generation_prompt=True,
                                     tokenize=False)
    return (*_hf_reference(hf, turns), text)


def test_generate_with_token_ids_or_text_matches_transformers(server, hf, photo_paths):
    # SGLang's native /generate: the chat-templated prompt's ids (or its text, tokenized as is) in, greedy ids and
    # their text out, equal to transformers' generate(); streamed events carry the text and ids so far.
    url, _ = server
    ref_prompt, ref_ids, ref_text, text = _templated_text_reference(hf, photo_paths)
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    for prompt in ({"input_ids": ref_prompt}, {"text": text}):
        r = httpx.post(f"{url}/generate", json={**prompt, "sampling_params": sampling}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output_ids"] == ref_ids and body["text"] == ref_text
        meta = body["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert meta["prompt_tokens"] == len(ref_prompt) and meta["completion_tokens"] == NEW_TOKENS
    with httpx.stream("POST", f"{url}/generate", json={"input_ids": ref_prompt, "sampling_params": sampling,
                                                       "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["output_ids"] == ref_ids and chunks[-1]["text"] == ref_text
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:]):  # cumulative, as SGLang streams by default
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]


def test_generate_rejects_what_it_cannot_serve(server):
    url, _ = server
    bad = [({"text": "a", "input_ids": [1]}, "exactly one"), ({}, "exactly one"),
           ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
           ({"input_ids": [10**9]}, "outside the vocabulary"),
           ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**7}}, "context length"),
           ({"input_ids": [1], "sampling_params": {"n": 17}}, "--max-n"),
           ({"input_ids": "abc"}, "input_ids")]
    for body, message in bad:
        r = httpx.post(f"{url}/generate", json=body, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) <= 2  # still serving


def test_completions_with_the_openai_client_match_transformers(server, hf, tiny_model_path, photo_paths):
    # OpenAI's legacy completions (a prompt, no chat template) through the official client, text and token-id
    # prompts, streaming and not: the greedy text equals transformers' generate() on the same ids.
    openai = pytest.importorskip("openai")
    url, _ = server
    ref_prompt, ref_ids, ref_text, text = _templated_text_reference(hf, photo_paths)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    kw = dict(model=tiny_model_path, max_tokens=NEW_TOKENS, temperature=0)
    for prompt in (text, ref_prompt):
        resp = client.completions.create(prompt=prompt, **kw, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert resp.object == "text_completion" and resp.choices[0].text == ref_text
        assert resp.choices[0].finish_reason == "length" and resp.choices[0].model_extra["token_ids"] == ref_ids
        assert resp.usage.prompt_tokens == len(ref_prompt) and resp.usage.completion_tokens == NEW_TOKENS
    chunks = list(client.completions.create(prompt=text, **kw, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    r = httpx.post(f"{url}/v1/completions", json={"model": tiny_model_path, "prompt": ["a", "b"]}, timeout=30)
    assert r.status_code == 400 and "batch" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": "a"}, timeout=30)
    assert r.status_code == 404


def test_logprobs_match_transformers_stream_and_not(server, hf, tiny_model_path, photo_paths):
    # Each sampled token's logprob and the top-5 at its step equal log_softmax of transformers' raw logits at that
    # step (generate(output_logits=True)); the OpenAI SDK parses them, streamed chunk by chunk and not.
    openai = pytest.importorskip("openai")
    url, _ = server
    turns = _resolve("one_photo", photo_paths)
    n = 12
    inputs, out = _hf_generate(hf, turns, n, output_logits=True, return_dict_in_generate=True)
    ref_ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    ref_lp = [torch.log_softmax(step[0].float(), -1) for step in out.logits]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY")
    kw = dict(model=tiny_model_path, messages=_openai_messages(turns), temperature=0, max_completion_tokens=n,
              logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    tok = hf[0].tokenizer
    for content in (whole, streamed):
        assert len(content) == n, (len(whole), len(streamed))
        assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == tok.decode(ref_ids)
        for step, (e, want_id, lp) in enumerate(zip(content, ref_ids, ref_lp)):
            assert e.logprob == pytest.approx(lp[want_id].item(), abs=1e-3), step
            top_v, top_i = lp.topk(5)
            assert [bytes(t.bytes) for t in e.top_logprobs] == [_token_bytes(tok, i) for i in top_i.tolist()], step
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-3), step
    no_lp = _chat(url, tiny_model_path, _openai_messages(turns))
    assert no_lp["choices"][0]["logprobs"] is None
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": tiny_model_path, "top_logprobs": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def _token_bytes(tokenizer, token_id: int) -> bytes:
    """Exact bytes of a byte-level BPE token (the inverse of transformers' bytes_to_unicode)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def test_presence_and_frequency_penalties_match_transformers(server, hf, tiny_model_path, photo_paths):
    # Greedy output with OpenAI's penalties equals transformers' generate() with the same formula as a logits
    # processor over the generated tokens (prompt excluded), streaming and not; without penalties this prompt
    # repeats tokens, so the penalties change the text.
    from transformers import LogitsProcessor, LogitsProcessorList

    class Penalties(LogitsProcessor):
        def __init__(self, prompt_len, frequency, presence):
            self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

        def __call__(self, input_ids, scores):
            out = input_ids[:, self.prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            return scores - self.frequency * counts - self.presence * (counts > 0)

    url, _ = server
    turns = _resolve("one_photo", photo_paths)
    plain = _hf_reference(hf, turns)[1]
    prompt_len = _hf_inputs(hf, turns)["input_ids"].shape[1]
    _, out = _hf_generate(hf, turns, logits_processor=LogitsProcessorList([Penalties(prompt_len, 0.7, 0.4)]))
    ref_ids = out[0, prompt_len:].tolist()
    assert ref_ids != plain
    body = {"frequency_penalty": 0.7, "presence_penalty": 0.4}
    resp = _chat(url, tiny_model_path, _openai_messages(turns), **body)
    assert resp["choices"][0]["token_ids"] == ref_ids
    assert resp["choices"][0]["message"]["content"] == hf[0].tokenizer.decode(ref_ids, skip_special_tokens=True)
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "model": tiny_model_path, "messages": _openai_messages(turns), "temperature": 0, "ignore_eos": True,
        "max_completion_tokens": NEW_TOKENS, "stream": True, "return_token_ids": True, **body}, timeout=120)
    events = [json.loads(e) for e in _sse_events(r) if e != "[DONE]"]
    assert [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []] == ref_ids
    bad = httpx.post(f"{url}/v1/chat/completions", json={"model": tiny_model_path, "frequency_penalty": 2.5,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and "frequency_penalty" in bad.text


def test_logit_bias_matches_transformers_and_unsupported_fields_are_refused(server, hf, tiny_model_path,
                                                                            photo_paths):
    # logit_bias bans the unbiased greedy first token and favours two others; transformers' generate() with the
    # same bias as a logits processor (every step, the first included) gives the same ids. A JSON schema xgrammar
    # rejects and a tool_choice naming no tool are refused with 400, not silently ignored.
    from transformers import LogitsProcessor, LogitsProcessorList

    url, _ = server
    turns = _resolve("one_photo", photo_paths)
    plain = _hf_reference(hf, turns)[1]
    bias = {plain[0]: -100.0, plain[3]: 4.0, 17: 2.5}

    class Bias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for t, b in bias.items():
                scores[:, t] += b
            return scores

    inputs, out = _hf_generate(hf, turns, logits_processor=LogitsProcessorList([Bias()]))
    ref_ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ref_ids[0] != plain[0]
    resp = _chat(url, tiny_model_path, _openai_messages(turns), logit_bias={str(t): b for t, b in bias.items()})
    assert resp["choices"][0]["token_ids"] == ref_ids
    msgs = [{"role": "user", "content": "hi"}]
    for extra, word in (({"logit_bias": {"99999999": 1}}, "vocabulary"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
                         "Unsupported type"),
                        ({"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not in tools")):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": tiny_model_path, "messages": msgs, **extra})
        assert r.status_code == 400 and word in r.text, (extra, r.text)
    ok = _chat(url, tiny_model_path, msgs, response_format={"type": "text"}, tools=[])
    assert ok["choices"][0]["finish_reason"] == "length"


def stream_text(url: str, model: str, messages: list) -> tuple[str, int]:
    """The streamed answer's text (deltas joined) and its usage's completion tokens."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_completion_tokens": NEW_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]["completion_tokens"]


def check_parity(url: str, model: str, turns, reference) -> dict:
    """One request for ``turns`` (:func:`_openai_messages`' input) non-streaming and one streaming, both equal to
    ``reference`` (transformers' ``(prompt ids, greedy ids, text)``, :func:`_hf_reference`); returns the
    non-streaming answer."""
    ref_prompt, ref_ids, ref_text = reference
    messages = _openai_messages(turns)
    resp = _chat(url, model, messages)
    assert resp["prompt_token_ids"] == ref_prompt
    assert resp["choices"][0]["token_ids"] == ref_ids
    assert resp["choices"][0]["message"]["content"] == ref_text
    assert stream_text(url, model, messages) == (ref_text, NEW_TOKENS)
    return resp
