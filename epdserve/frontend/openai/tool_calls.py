"""Tool calls out of a Qwen model's text, incrementally: hermes-style blocks ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`` (the format the Qwen2.5 and Qwen3(-VL) chat templates teach) become OpenAI tool calls, and the
text outside them stays content.

The algorithm follows vLLM's hermes tool parser (``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py``)
and SGLang's ``Qwen25Detector``: text before a block streams as content, held back only while it could be the
start of ``<tool_call>``; a block's name is sent once its ``"name"`` string is complete, then the arguments' text
as it arrives. Unlike vLLM (which re-serializes partial JSON with ``partial_json_parser`` and streams the
differences) the arguments are the model's own text, cut where their JSON value ends (a scan of brackets and
strings), so the streamed fragments and the whole answer (:func:`parse_tool_calls`, the same parser fed once)
agree character for character.

Rules the parser keeps: tool-call text never becomes content (a block cut off by the end of the output is dropped,
or keeps the arguments streamed so far); a complete block whose keys come in another order (``"arguments"`` first)
is still a call when its JSON parses, else it stays content; whitespace after a block is dropped unless more
content follows.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from epdserve.frontend.tool_prompt import END, START

_WS = " \t\r\n"
# The block's opening up to its arguments value: a JSON object whose first key is "name", then "arguments".
_HEAD = ["{", '"name"', ":", None, ",", '"arguments"', ":"]  # None: the name, a JSON string


def new_call_id() -> str:
    """A tool call id: ``call_`` and 24 random hex digits (OpenAI's prefix), unique per call."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    """One piece of a streamed tool call (OpenAI's ``delta.tool_calls[]`` entry): the first piece of call ``index``
    has its ``id`` and ``name`` (and ``arguments`` ""), later ones only argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    """A tool call as parsed so far: ``arguments`` is the JSON text of its arguments (complete once the block
    closed)."""

    id: str
    name: str
    arguments: str = ""


def _head(buf: str) -> tuple[str, int] | bool | None:
    """``(name, end)`` when ``buf`` starts with a complete block head (``end``: where the arguments value starts,
    its first character already in ``buf``); None when ``buf`` may still become one; False when it cannot."""
    pos = 0
    for part in _HEAD:
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
        if pos == len(buf):
            return None
        if part is None:
            if buf[pos] != '"':
                return False
            end = _string_end(buf, pos)
            if end is None:
                return None
            try:
                name = json.loads(buf[pos:end])
            except ValueError:
                return False
            pos = end
        else:
            got = buf[pos:pos + len(part)]
            if not part.startswith(got):
                return False
            if len(got) < len(part):
                return None
            pos += len(part)
    while pos < len(buf) and buf[pos] in _WS:
        pos += 1
    return (name, pos) if pos < len(buf) else None


def _string_end(text: str, start: int) -> int | None:
    """The index after the JSON string starting at ``text[start]`` (a quote), or None when it is not closed yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


@dataclass
class _ValueScan:
    """Where a JSON value ends, fed piece by piece: brackets outside strings, string escapes, and scalars that end
    at the first delimiter."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False
    scalar: bool = False

    def feed(self, text: str) -> int | None:
        """How many characters of ``text`` belong to the value when it ends in ``text``, else None (all of it)."""
        for i, c in enumerate(text):
            if not self.started:
                self.started = True
                self.scalar = c not in '{["'
                self.in_string = c == '"'
                self.depth = 1 if c in "{[" else 0
                continue
            if self.scalar:
                if c in _WS + ",}]":
                    return i
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class ToolCallParser:
    """Splits a model's output text into content and tool calls as it arrives.

    :meth:`feed` each text delta, then :meth:`finish` once at the end; each returns ``(content delta, tool call
    deltas)``. :attr:`calls` holds the calls parsed so far (the whole answer's ``tool_calls``). ``max_calls``
    (``parallel_tool_calls: false``: 1) drops the blocks after that many calls, as vLLM keeps only the first.
    """

    max_calls: int | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"  # text | head | args | tail | raw | skip
    _ws: str = ""  # whitespace after the last content, held until more content shows it is not trailing
    _after_block: bool = False  # a block just ended: whitespace is not content until something else comes
    _scan: _ValueScan | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of the output; returns the content and tool-call deltas it completes."""
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the output: release held content (trailing whitespace only when no call was made); a block still
        open is dropped (its arguments so far stay with its call if they started streaming)."""
        content: list[str] = []
        if self._state == "text":
            self._emit(content, self._buf, last=True)
            if not self.calls:
                content.append(self._ws)
        self._buf, self._ws, self._state = "", "", "done"
        return "".join(content), []

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """One transition of the state machine over the buffer; False when it needs more text."""
        handler = getattr(self, f"_on_{self._state}")
        return handler(content, deltas)

    def _on_text(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        at = self._buf.find(START)
        if at >= 0:
            self._emit(content, self._buf[:at], last=True)
            self._ws, self._buf, self._state = "", self._buf[at + len(START):], "head"
            return True
        keep = _partial_suffix(self._buf, START)
        self._emit(content, self._buf[:len(self._buf) - keep], last=True)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _emit(self, content: list[str], text: str, last: bool) -> None:
        """Content ``text``. Whitespace next to a block is not content: after a block it is dropped, and with
        ``last`` (more may follow: a block, perhaps) the trailing whitespace is held until content follows."""
        if self._after_block:
            text = text.lstrip(_WS)
            self._after_block = not text
        body = text.rstrip(_WS) if last else text
        if body:
            content.append(self._ws + body)
            self._ws = ""
        self._ws += text[len(body):]

    def _on_head(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._state = "skip"
            return True
        head = _head(self._buf)
        if head is None:
            return False
        if head is False:
            self._state = "raw"
            return True
        name, end = head
        call = ParsedCall(new_call_id(), name)
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, name))
        self._buf, self._scan, self._state = self._buf[end:], _ValueScan(), "args"
        return True

    def _on_args(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        if not self._buf:
            return False
        used = self._scan.feed(self._buf)
        piece = self._buf if used is None else self._buf[:used]
        self.calls[-1].arguments += piece
        deltas.append(ToolCallDelta(len(self.calls) - 1, piece))
        self._buf = "" if used is None else self._buf[used:]
        if used is not None:
            self._state = "tail"
        return used is not None

    def _on_tail(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        # After the arguments: the closing brace and END; anything else the model wrote there is dropped (and so is
        # a whole block past max_calls: _on_skip).
        at = self._buf.find(END)
        if at < 0:
            return False
        self._buf, self._state, self._after_block = self._buf[at + len(END):], "text", True
        return True

    _on_skip = _on_tail

    def _on_raw(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        # A block that does not start with "name" then "arguments": whole, it may still be a call.
        at = self._buf.find(END)
        if at < 0:
            return False
        body, self._buf, self._state = self._buf[:at], self._buf[at + len(END):], "text"
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            call = ParsedCall(new_call_id(), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))
            self.calls.append(call)
            deltas.append(ToolCallDelta(len(self.calls) - 1, call.arguments, call.id, call.name))
            self._after_block = True
        else:
            self._emit(content, START + body + END, last=False)
        return True

    def _on_done(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        raise RuntimeError("the parser was fed after finish()")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str, list[ParsedCall]]:
    """A whole output's ``(content, calls)``: the same parser as the stream (:class:`ToolCallParser`), fed once,
    so a streamed answer's deltas add up to this."""
    parser = ToolCallParser(max_calls)
    content, _ = parser.feed(text)
    tail, _ = parser.finish()
    return content + tail, parser.calls
