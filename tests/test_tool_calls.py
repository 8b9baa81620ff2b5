"""Tool calling's pieces on their own (no server): the incremental hermes parser
(epdserve/frontend/openai/tool_calls.py) on hand-written model outputs split at every character, the stream's delta
shape, the required/named grammar (xgrammar structural tag) and the prompt text for chat templates that ignore
tools."""

from __future__ import annotations

import json
import re

import pytest

from epdserve.frontend.openai.tool_calls import ToolCallParser, parse_tool_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa}ri\\"s{", "days": [1, {"x": null}]}}'
OUTPUTS = [
    # (model output, content, [(name, arguments)], max_calls)
    (f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
     '{"name": "time", "arguments": {}}\n</tool_call>\n',
     "Let me look.", [("get_weather", {"city": 'Pa}ri"s{', "days": [1, {"x": None}]}), ("time", {})], None),
    ("No tools needed <here> 1 < 2.  \n", "No tools needed <here> 1 < 2.  \n", [], None),
    # keys in the other order: parsed whole once the block closes
    ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', "", [("f", {"a": 1})], None),
    # not JSON: the block stays content
    ("<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", [], None),
    # text after a call is content; the whitespace around the block is not
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n\nDone.", "Done.",
     [("get_weather", {"city": 'Pa}ri"s{', "days": [1, {"x": None}]})], None),
    # parallel_tool_calls false: the second block is dropped, not content
    ('<tool_call>{"name": "a", "arguments": {"k": "v"}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
     "</tool_call>", "", [("a", {"k": "v"})], 1),
    # the output ended inside a block: its head is dropped, a started call keeps its arguments so far
    ('Hi <tool_call>\n{"name": "f", "argu', "Hi", [], None),
    ("ends with <tool_ca", "ends with <tool_ca", [], None),
]


def _feed_split(text: str, cuts: list[int], max_calls):
    parser = ToolCallParser(max_calls)
    content, deltas = "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        c, d = parser.feed(text[a:b])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    return content + c, deltas + d, parser.calls


@pytest.mark.parametrize("text,content,calls,max_calls", OUTPUTS)
def test_the_parser_gives_the_same_content_and_calls_however_the_text_is_split(text, content, calls, max_calls):
    whole_content, whole = parse_tool_calls(text, max_calls)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole] == calls
    splits = [[k] for k in range(len(text) + 1)] + [list(range(1, len(text)))]  # every cut, and char by char
    for cuts in splits:
        got, deltas, parsed = _feed_split(text, cuts, max_calls)
        assert got == content, cuts
        assert "<tool_call>" not in got or not calls, cuts  # a call's text never leaks into content
        assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in whole], cuts
        joined: dict[int, str] = {}
        for d in deltas:
            # the first delta of a call names it and gives its id; later ones only carry argument text
            assert (d.index not in joined) == (d.id is not None) == (d.name is not None), (cuts, d)
            joined[d.index] = joined.get(d.index, "") + d.arguments
        assert [joined[i] for i in range(len(parsed))] == [c.arguments for c in parsed], cuts
        ids = [c.id for c in parsed]
        assert len(set(ids)) == len(ids) and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_a_call_cut_off_keeps_its_streamed_arguments():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": "unfini')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": "unfini')]


def test_the_stream_sends_one_delta_per_call_per_chunk_in_openai_shape():
    from epdserve.frontend.openai.tools import ToolPlan, ToolStream

    stream = ToolStream(ToolPlan([], parse=True))
    content, calls = stream.feed('Sure. <tool_call>\n{"name": "f", "arguments": {"a"', last=False)
    assert content == "Sure." and len(calls) == 1 and stream.called
    first = calls[0].model_dump(exclude_none=True)
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "f", "arguments": '{"a"'}
    content, calls = stream.feed(': 1}}\n</tool_call>', last=True)
    assert content == "" and [c.model_dump(exclude_none=True) for c in calls] == [
        {"index": 0, "function": {"arguments": ": 1}"}}]
    plain = ToolStream(None)
    assert plain.feed("<tool_call>x", last=True) == ("<tool_call>x", None) and not plain.called


def _matcher(grammar):
    import xgrammar as xgr

    from epdserve.engine.grammar_build import build_grammar

    chars = [chr(i) for i in range(32, 127)] + ["\n", "<eos>"]
    info = xgr.TokenizerInfo(chars, stop_token_ids=[len(chars) - 1])
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(grammar))
    eos = len(chars) - 1

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.accept_token(eos)
    return accepts


def test_the_required_and_named_grammar_allows_only_blocks_that_follow_the_schemas():
    from epdserve.frontend.openai.tool_protocol import FunctionDefinition
    from epdserve.frontend.openai.tools import tool_call_grammar

    weather = FunctionDefinition(name="get_weather", parameters={
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "maximum": 9}},
        "required": ["city"]})
    clock = FunctionDefinition(name="clock")  # no parameters: {} only
    block = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format
    ok_w, ok_c = block("get_weather", '{"city": "Rome", "days": 3}'), block("clock", "{}")
    many = _matcher(tool_call_grammar([weather, clock], one=False))
    assert many(ok_w) and many(ok_c) and many(f"{ok_w}\n{ok_c}\n{ok_w}")
    for bad in ("", f"Sure. {ok_w}", block("get_weather", '{"days": 3}'), block("get_weather", '{"city": "R", "x": 1}'),
                block("get_weather", '{"city": "R", "days": 10}'), block("clock", '{"a": 1}'), block("other", "{}"),
                block("get_weather", '{"city":"Rome"}'), f"{ok_w}\nmore text",
                # a raw control character is not JSON (xgrammar's bounded strings let them through: grammar.py)
                block("get_weather", '{"city": "a\x0fb"}')):
        assert not many(bad), bad
    one = _matcher(tool_call_grammar([weather], one=True))
    assert one(ok_w) and not one(f"{ok_w}\n{ok_w}") and not one(ok_c)


def test_templates_without_tools_get_the_text_a_tools_template_writes():
    """The Qwen2-VL/2.5-VL template ignores tools; what epdserve writes into its messages renders as Qwen3-VL's
    template renders tools, calls and results (past the system prompt, which only Qwen2-VL's template adds)."""
    from epdserve.frontend.openai.chat import to_hf_messages
    from epdserve.frontend.openai.protocol import ChatMessage
    from epdserve.frontend.tool_prompt import DEFAULT_SYSTEM, hermes_messages
    from epdserve.models.checkpoint_parts import CHAT_TEMPLATE, build_tokenizer
    from epdserve.models.qwen3_vl_checkpoint import QWEN3_VL_CHAT_TEMPLATE

    tok = build_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}, {"type": "text", "text": "Hi?"}]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
        {"role": "assistant", "content": "Snow and rain."}, {"role": "user", "content": "Thanks"}]]
    hf, urls, _ = to_hf_messages(messages)
    assert urls == ["data:,"] and hf[1]["tool_calls"][1]["function"]["arguments"] == {}
    reference = tok.apply_chat_template(hf, chat_template=QWEN3_VL_CHAT_TEMPLATE, tools=tools,
                                        add_generation_prompt=True, tokenize=False)
    ours = tok.apply_chat_template(hermes_messages(hf, tools), chat_template=CHAT_TEMPLATE,
                                   add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsnow\n</tool_response>\n<tool_response>\nrain" in ours
    assert ours == reference.replace("<|im_start|>system\n", f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n", 1)
    # a system message of the client's keeps its text, then the tools block follows it
    sys_first = hermes_messages([{"role": "system", "content": "Be brief."}, *hf], tools)
    assert sys_first[0]["content"].startswith("Be brief.\n\n# Tools")
    assert len(sys_first) == len(hf)  # one more system message, one tool result merged into the other
