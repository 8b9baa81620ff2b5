"""Tool calling on chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> what the prompt
renders, the grammar of a forced call, and the answer's ``tool_calls`` (whole or as stream deltas).

- ``tool_choice`` ``none``: the tools are still rendered (vLLM's default), the output is plain content.
- ``auto`` (the default with tools): free generation; hermes ``<tool_call>`` blocks in the output become
  ``tool_calls`` (:mod:`epdserve.frontend.openai.tool_calls`), the text around them content.
- ``required``, or a named function: an xgrammar structural tag (one more ``GrammarSpec`` type,
  ``structural_tag``) allows only one or more blocks ``<tool_call>\\n{"name": <a tool>, "arguments": <its
  parameters>}\\n</tool_call>`` separated by newlines, then the end of the output: so the arguments always parse
  and follow the schema (compact JSON, strict as :func:`epdserve.engine.grammar.build_grammar`). A named function,
  or ``parallel_tool_calls: false``, allows exactly one. This is SGLang's approach (its ``tool_choice`` EBNF of
  the detector's format) with xgrammar's structural tags; vLLM forces a JSON list instead, which Qwen models were
  not trained to write.

``finish_reason`` is ``tool_calls`` when the output made a call and ended normally (SGLang's rule, for named
functions too; OpenAI and vLLM say ``stop`` there).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from epdserve.engine.grammar_build import GrammarError, build_grammar
from epdserve.frontend.errors import APIError
from epdserve.frontend.openai.tool_calls import ParsedCall, ToolCallParser, parse_tool_calls
from epdserve.frontend.openai.tool_protocol import (
    DeltaFunctionCall, DeltaToolCall, FunctionCall, FunctionDefinition, NamedToolChoice, Tool, ToolCall,
)
from epdserve.frontend.structured import checked
from epdserve.frontend.tool_prompt import END, START
from epdserve.wire.messages import MAX_GRAMMAR_CHARS, GrammarSpec


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do.

    Attributes:
        functions: the tools' functions as the chat template takes them (``tools=`` of ``apply_chat_template``).
        parse: whether the output is parsed into tool calls (``auto``, ``required``, a named function).
        grammar: the constraint of ``required`` or a named function, else None.
        max_calls: 1 with ``parallel_tool_calls: false`` or a named function, else None (no limit).
    """

    functions: list[dict[str, Any]]
    parse: bool
    grammar: GrammarSpec | None = None
    max_calls: int | None = None


async def tool_plan(tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool,
                    constrained: bool) -> ToolPlan | None:
    """The plan of a chat request's ``tools``/``tool_choice``/``parallel_tool_calls`` (None: no tools, so
    nothing to render or parse); ``constrained``: the request also has a ``response_format`` or
    ``structured_outputs`` grammar. The grammar is checked with xgrammar on a worker thread.

    Raises:
        APIError: 400 for ``tool_choice`` (other than ``none``) without tools, a named function not in
            ``tools``, two tools with one name, ``required``/named together with another output constraint, or
            a ``parameters`` schema xgrammar rejects (its message).
    """
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools has more than one function named {dup!r}", param="tools")
    functions = [{"type": "function", "function": t.function.for_template()} for t in tools]
    forced = [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        forced = [t.function for t in tools if t.function.name == choice.function.name]
        if not forced:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                                f"({', '.join(names)})", param="tool_choice")
    elif choice in (None, "auto", "none"):
        return ToolPlan(functions, parse=choice != "none", max_calls=None if parallel else 1)
    if constrained:
        raise APIError(400, "tool_choice required or a named function constrains the output itself: give it or "
                            "response_format/structured_outputs, not both", param="tool_choice")
    one = isinstance(choice, NamedToolChoice) or not parallel
    grammar = await asyncio.to_thread(tool_call_grammar, forced, one)
    if len(grammar.text) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"the tools' grammar has {len(grammar.text)} characters, over the limit of "
                            f"{MAX_GRAMMAR_CHARS}", param="tools")
    return ToolPlan(functions, parse=True, grammar=await checked(grammar, "tools"), max_calls=1 if one else None)


def tool_call_grammar(functions: list[FunctionDefinition], one: bool) -> GrammarSpec:
    """The ``structural_tag`` grammar of one or more hermes tool-call blocks (exactly one with ``one``), each
    naming one of ``functions`` with arguments that follow its ``parameters`` (none: ``{}`` only, as OpenAI
    defines a function without parameters), blocks separated by ``\\n``, then the end of the output.

    Each schema becomes xgrammar's compact, strict JSON grammar (:func:`build_grammar`'s ``json_schema``), embedded
    as EBNF: xgrammar's own ``json_schema`` format in a structural tag allows any whitespace.

    Raises:
        APIError: 400 naming the tool whose ``parameters`` xgrammar rejects, with xgrammar's message.
    """
    tags = []
    for f in functions:
        schema = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        try:
            ebnf = str(build_grammar(GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))))
        except GrammarError as e:
            raise APIError(400, f"invalid parameters of tool {f.name!r}: {e}", param="tools") from None
        name = json.dumps(f.name, ensure_ascii=False)
        tags.append({"type": "tag", "begin": f'{START}\n{{"name": {name}, "arguments": ',
                     "content": {"type": "grammar", "grammar": ebnf}, "end": f"}}\n{END}"})
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": one}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_message(plan: ToolPlan | None, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A whole answer's ``(content, tool_calls)``: ``text`` and None unless the plan parses; then the content
    around the blocks (None when empty) and the calls (None when there are none)."""
    if plan is None or not plan.parse:
        return text, None
    content, calls = parse_tool_calls(text, plan.max_calls)
    return content or None, [_tool_call(c) for c in calls] or None


def finish_reason(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for an output that made a call and ended normally (``stop``), else ``reason``."""
    return "tool_calls" if called and reason == "stop" else reason


class ToolStream:
    """One streamed answer's text deltas -> content and tool-call deltas (:class:`ToolCallParser`); without a
    plan that parses, the text passes through as content."""

    def __init__(self, plan: ToolPlan | None):
        self._parser = ToolCallParser(plan.max_calls) if plan is not None and plan.parse else None

    @property
    def called(self) -> bool:
        """Whether the output has made a tool call so far."""
        return self._parser is not None and bool(self._parser.calls)

    def feed(self, text: str, last: bool) -> tuple[str, list[DeltaToolCall] | None]:
        """The content and tool-call deltas of ``text``; ``last``: the output's final piece (held text is
        released)."""
        if self._parser is None:
            return text, None
        content, deltas = self._parser.feed(text)
        if last:
            tail, more = self._parser.finish()
            content, deltas = content + tail, deltas + more
        # One entry per call in a chunk: a call's head and its first argument text travel together.
        merged: dict[int, DeltaToolCall] = {}
        for d in deltas:
            if d.id is None and not d.arguments:
                continue
            if d.index in merged:
                merged[d.index].function.arguments += d.arguments
            elif d.id is not None:
                merged[d.index] = DeltaToolCall(index=d.index, id=d.id, type="function",
                                                function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
            else:
                merged[d.index] = DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
        return content, list(merged.values()) or None
