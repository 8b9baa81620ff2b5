"""The request fields of structured outputs, as the protocols spell them (OpenAI's ``response_format``, vLLM's
``structured_outputs``); :mod:`epdserve.frontend.structured` turns them into the stages' grammar."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` request field (one constraint of the five)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
