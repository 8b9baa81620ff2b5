"""OpenAI's ``response_format`` (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}``; ``strict`` or not, the output follows the schema: xgrammar's strict mode) and a chat
request's grammar from it or from vLLM's ``structured_outputs`` (:mod:`epdserve.frontend.structured`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from epdserve.frontend.errors import APIError
from epdserve.frontend.structured import StructuredOutputs, checked, schema_text, structured_outputs_grammar
from epdserve.wire.messages import GrammarSpec


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI's): ``name``/``description`` are accepted and unused."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


def response_format_grammar(fmt: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar of OpenAI's ``response_format`` (None for none or ``text``).

    Raises:
        APIError: 400 for ``json_schema`` without a ``schema``.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return GrammarSpec("json_schema", schema_text(fmt.json_schema.schema_))


async def chat_grammar(fmt: ResponseFormat | None, so: StructuredOutputs | None) -> GrammarSpec | None:
    """A chat request's grammar from ``response_format`` or ``structured_outputs``, checked with xgrammar.

    Raises:
        APIError: 400 when both constrain the output, when xgrammar rejects it, or for either field's own
            problems.
    """
    rf, sg = response_format_grammar(fmt), structured_outputs_grammar(so)
    if rf is not None and sg is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="response_format")
    return await checked(rf, "response_format") if rf is not None else await checked(sg, "structured_outputs")
