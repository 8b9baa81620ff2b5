"""Tool calling (issue 28) end to end through ``epdserve launch`` of the tiny readable checkpoint and the ``openai``
SDK: random weights, so every call that parses and validates is the grammar's doing.

The tools' schemas are bounded (short strings, bounded integers, enums), so a valid call fits ``max_tokens``. The
parser itself is tested on hand-written model outputs in tests/test_tool_calls.py.
"""

from __future__ import annotations

import base64
import json

import httpx
import jsonschema
import pytest

from conftest import launched

MAX_TOKENS = 160  # one call takes about 70 tokens of the tiny byte-level tokenizer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "what": {"type": "string", "maxLength": 6}}, "required": ["n", "what"]}
SCHEMAS = {"get_weather": WEATHER, "count_objects": COUNT}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of the picture",
                                           "parameters": schema}} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    """One launch for the module: (base URL, model name)."""
    from epdserve.models.tiny import make_tiny_model

    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny-readable-tools"), readable=True))
    with launched(model, tmp_path_factory.mktemp("launch-tools")) as (url, _):
        yield url, model


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _messages(photo_paths) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(photo_paths["coffee"].read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "How many cups, and the weather?"}]}]


def _check_calls(calls) -> list[tuple[str, str]]:
    """Every call names a tool and its arguments validate against that tool's parameters."""
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, c.function.arguments) for c in calls]


def _streamed(stream) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) reassembled from the deltas, checking their shape: a call's
    first delta has its id, type and name, later ones argument text only."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name in SCHEMAS
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))], finish


def test_required_returns_calls_that_validate_and_the_stream_reassembles_to_them(tools_server, photo_paths):
    url, model = tools_server
    client = _client(url)
    kw = dict(model=model, messages=_messages(photo_paths), tools=TOOLS, tool_choice="required",
              max_completion_tokens=3 * MAX_TOKENS)
    counts = []
    for seed in (None, 3, 11):  # greedy, and sampled with a seed (reproducible, so the stream must agree)
        sample = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        out = client.chat.completions.create(**kw, **sample)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        whole = _check_calls(choice.message.tool_calls)
        content, streamed, finish = _streamed(client.chat.completions.create(**kw, **sample, stream=True))
        assert content == "" and finish == "tool_calls"
        assert streamed == whole
        counts.append(len(whole))
    assert max(counts) > 1  # parallel calls (the default) happen, newline-separated blocks


def test_a_named_function_and_parallel_tool_calls_false_give_exactly_one_call(tools_server, photo_paths):
    url, model = tools_server
    client = _client(url)
    msgs = _messages(photo_paths)
    named = {"type": "function", "function": {"name": "count_objects"}}
    for seed in (1, 2, 4):
        out = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice=named,
                                             max_completion_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        assert [name for name, _ in _check_calls(out.choices[0].message.tool_calls)] == ["count_objects"]
        # Sampled from random weights, a block is as likely followed by "\n" as by the end: only the grammar
        # stops a second call.
        out = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_completion_tokens=MAX_TOKENS,
                                             temperature=1.0, seed=seed)
        assert len(_check_calls(out.choices[0].message.tool_calls)) == 1
        assert out.choices[0].finish_reason == "tool_calls"


def _prompt_text(url: str, model: str, body: dict) -> tuple[dict, str]:
    from transformers import AutoTokenizer

    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "max_tokens": 8, "temperature": 0,
                                                       "return_token_ids": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out, AutoTokenizer.from_pretrained(model).decode(out["prompt_token_ids"])


def test_history_with_calls_and_results_and_auto_and_none_render_the_tools(tools_server, photo_paths):
    url, model = tools_server
    history = _messages(photo_paths) + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "count_objects",
                                                              "arguments": '{"n": 2, "what": "cups"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "snow, -3"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "two"}]},
        {"role": "user", "content": "So?"}]
    for choice in ("auto", "none"):
        out, prompt = _prompt_text(url, model, {"messages": history, "tools": TOOLS, "tool_choice": choice})
        # The tiny checkpoint's template (Qwen2.5-VL's) ignores tools: epdserve writes Qwen's hermes text itself.
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
        assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "count_objects"') in prompt
        assert "<tool_response>\nsnow, -3\n</tool_response>\n<tool_response>\ntwo\n</tool_response>" in prompt
        message = out["choices"][0]["message"]
        # Random weights write no <tool_call>: auto answers with content, as none does.
        assert message["content"] and not message.get("tool_calls")
        assert out["choices"][0]["finish_reason"] == "length"
    _, plain = _prompt_text(url, model, {"messages": history[:1]})
    assert "<tools>" not in plain and "tool_call" not in plain


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "'fly', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "Unsupported type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "not both"),
    ({"tools": TOOLS * 2}, "more than one function named"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "arguments must be JSON"),
]


def test_bad_tool_requests_get_400_and_the_server_keeps_serving(tools_server):
    url, model = tools_server
    msgs = [{"role": "user", "content": "hi"}]
    for extra, words in BAD:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": msgs, **extra}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    out = _client(url).chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                               max_completion_tokens=MAX_TOKENS, temperature=0)
    _check_calls(out.choices[0].message.tool_calls)
