"""The request and response fields of tool calling, as OpenAI's chat-completions API spells them (``tools``,
``tool_choice``, ``tool_calls`` in messages and stream deltas); :mod:`epdserve.frontend.openai.tools` acts on them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _is_none(value: object) -> bool:
    return value is None


_Omitted = Field(default=None, exclude_if=_is_none)  # left out of the JSON when unset, as OpenAI's deltas are


class FunctionDefinition(BaseModel):
    """A tool's function: ``parameters`` is a JSON schema of the arguments object (none: no arguments, as in
    OpenAI's API). ``strict`` is accepted; a constrained call always follows the schema."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        """The function as the chat templates render it (``tool | tojson``): the fields given, without nulls."""
        return self.model_dump(exclude_none=True, exclude={"strict"})


class Tool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A call's function as answered: ``arguments`` is JSON text (OpenAI's API), as the model wrote it."""

    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    """One tool call of an answer's assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class HistoryFunctionCall(BaseModel):
    """A call's function in a request's history: ``arguments`` is JSON text of an object (OpenAI's API) or the
    object itself; empty means ``{}``. :meth:`arguments_object` is what the chat templates take."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = ""

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, v):
        if isinstance(v, str) and v.strip():
            try:
                obj = json.loads(v)
            except ValueError:
                raise ValueError("a tool call's arguments must be JSON text of an object") from None
            if not isinstance(obj, dict):
                raise ValueError("a tool call's arguments must be a JSON object")
        return v

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as a dict (HF's tool-use format: the Qwen templates serialize it with ``tojson``)."""
        if isinstance(self.arguments, dict):
            return self.arguments
        return json.loads(self.arguments) if self.arguments.strip() else {}


class HistoryToolCall(BaseModel):
    """One tool call of an assistant message in a request's history."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = _Omitted
    arguments: str | None = _Omitted


class DeltaToolCall(BaseModel):
    """A stream delta's piece of tool call ``index``: the first has ``id``, ``type`` and the name, later ones
    argument text only (vLLM's and OpenAI's shape)."""

    index: int
    id: str | None = _Omitted
    type: Literal["function"] | None = _Omitted
    function: DeltaFunctionCall | None = _Omitted
