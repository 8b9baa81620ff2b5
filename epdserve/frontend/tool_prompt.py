"""Tools and tool-call history in the prompt, for chat templates that render them and for those that do not.

A template that renders tools (Qwen3-VL's; Qwen2.5's text models') gets them as transformers' ``tools=`` argument
and the history as in HF's tool-use docs: assistant messages with ``tool_calls`` whose ``arguments`` are dicts,
``role: "tool"`` messages. Qwen2-VL's and Qwen2.5-VL's released templates (``chat_template.json``) ignore all of
that, though the models were trained on the hermes format; for them (:func:`renders_tools` says no) the text a
tools template writes goes into the messages themselves (:func:`hermes_messages`): the tools block at the end
of the system message (the template's default system prompt when there is none), each call as a ``<tool_call>``
block in its assistant message, and each run of tool results as one user message of ``<tool_response>`` blocks.
vLLM passes the tools to such a template and the model never sees them; epdserve renders them, so ``auto``
works on every Qwen-VL checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

# The tags around one call in a hermes block, as the model writes it (epdserve.frontend.openai.tool_calls parses them).
START, END = "<tool_call>", "</tool_call>"
_PROBE = "epdserve_probe_function"
# Qwen2-VL's template's system prompt when the messages have none.
DEFAULT_SYSTEM = "You are a helpful assistant."
# The Qwen2.5 (and Qwen3) chat templates' tools block, word for word.
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
               "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def renders_tools(processor: Any) -> bool:
    """Whether ``processor``'s chat template renders ``tools`` (a probe function's name shows up in its text)."""
    probe = [{"type": "function", "function": {"name": _PROBE}}]
    try:
        text = processor.apply_chat_template([{"role": "user", "content": "x"}], tools=probe,
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001  (a template that fails on tools does not render them)
        return False
    return _PROBE in text


def tools_text(functions: list[dict[str, Any]]) -> str:
    """The tools block of the system message: every function as one JSON line (``tool | tojson``)."""
    return TOOLS_INTRO + "".join("\n" + json.dumps(f, ensure_ascii=False) for f in functions) + TOOLS_OUTRO


def call_text(call: dict[str, Any]) -> str:
    """One ``tool_calls`` entry of an HF message (``arguments`` a dict) as the hermes block the model writes."""
    f = call.get("function", call)
    args = json.dumps(f["arguments"], ensure_ascii=False)
    return f'{START}\n{{"name": {json.dumps(f["name"], ensure_ascii=False)}, "arguments": {args}}}\n{END}'


def _append(content: str | list[dict[str, Any]], text: str) -> str | list[dict[str, Any]]:
    return content + text if isinstance(content, str) else [*content, {"type": "text", "text": text}]


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def hermes_messages(hf_messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None) -> list[dict]:
    """``hf_messages`` with the tools (``functions``, None or empty: none), tool calls and tool results written
    into plain system, assistant and user messages: the text Qwen3-VL's template renders for them (its tools block
    is Qwen2.5's word for word), checked in tests/test_tool_calls.py."""
    out: list[dict[str, Any]] = []
    prev_tool = False  # the last message was a tool result: the next one joins its user message
    for msg in hf_messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            content = msg.get("content") or ""
            for i, call in enumerate(msg["tool_calls"]):
                sep = "\n" if i or (content if isinstance(content, str) else any(content)) else ""
                content = _append(content, sep + call_text(call))
            out.append({"role": "assistant", "content": content})
        elif msg["role"] == "tool":
            block = [{"type": "text", "text": ("\n" if prev_tool else "") + "<tool_response>\n"},
                     *_as_parts(msg["content"]), {"type": "text", "text": "\n</tool_response>"}]
            if prev_tool:
                out[-1]["content"] += block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({k: v for k, v in msg.items() if k in ("role", "content")})
        prev_tool = msg["role"] == "tool"
    if functions:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": _append(out[0]["content"], "\n\n" + tools_text(functions))}
        else:
            out.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{tools_text(functions)}"})
    return out
