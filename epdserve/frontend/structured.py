"""Structured outputs in the terms more than one protocol shares, turned into the one
:class:`~epdserve.wire.messages.GrammarSpec` the stages take (``SamplingParams.grammar``), and checked with
xgrammar (:func:`checked`) before any stage sees the request.

- vLLM's ``structured_outputs`` (OpenAI chat and completions, ``/generate``): one of ``json`` (a schema, object or
  text), ``regex``, ``choice`` (a list of strings, as an EBNF alternation), ``grammar`` (EBNF) or ``json_object``.
- SGLang's sampling parameters (``/generate``, the scheduler gRPC protocols): ``json_schema`` (text;
  ``"$$ANY$$"``: any JSON object), ``regex`` or ``ebnf``.

Two constraints on one request get a 400, as does anything xgrammar rejects (its message). OpenAI's
``response_format`` is :mod:`epdserve.frontend.openai.response_format`'s; tool calling's grammar (``tool_choice``
required or a named function, a ``structural_tag``) is built by :mod:`epdserve.frontend.openai.tools`; both are
checked with :func:`checked` here.
"""

from __future__ import annotations

import asyncio
import json

from pydantic import BaseModel, ConfigDict, Field

from epdserve.engine.grammar_build import GrammarError, build_grammar
from epdserve.frontend.errors import APIError
from epdserve.wire.messages import GrammarSpec

_ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for any JSON object


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` request field (one constraint of the five)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None


def _one(found: list[GrammarSpec], what: str, param: str) -> GrammarSpec | None:
    if len(found) > 1:
        raise APIError(400, f"give only one of {what}", param=param)
    return found[0] if found else None


def schema_text(schema: dict | str) -> str:
    """A JSON schema given as an object or as text, as text."""
    return schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)


def _choice_ebnf(choice: list[str]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are also xgrammar's EBNF string escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def structured_outputs_grammar(so: StructuredOutputs | None) -> GrammarSpec | None:
    """The grammar of vLLM's ``structured_outputs`` (None for none).

    Raises:
        APIError: 400 for more than one constraint, or ``structural_tag`` (not supported yet).
    """
    if so is None:
        return None
    if so.structural_tag is not None:
        raise APIError(400, "structured_outputs.structural_tag is not supported", param="structured_outputs")
    found = []
    if so.json_ is not None:
        found.append(GrammarSpec("json_schema", schema_text(so.json_)))
    if so.regex is not None:
        found.append(GrammarSpec("regex", so.regex))
    if so.choice is not None:
        found.append(GrammarSpec("ebnf", _choice_ebnf(so.choice)))
    if so.grammar is not None:
        found.append(GrammarSpec("ebnf", so.grammar))
    if so.json_object:
        found.append(GrammarSpec("json_object"))
    return _one(found, "structured_outputs' json, regex, choice, grammar and json_object", "structured_outputs")


async def generate_grammar(json_schema: str | None, regex: str | None, ebnf: str | None,
                           so: StructuredOutputs | None) -> GrammarSpec | None:
    """A prompt-in request's grammar, checked (:func:`checked`): SGLang's ``json_schema``/``regex``/``ebnf``
    sampling params (``/generate``) or vLLM's ``structured_outputs`` (``/v1/completions``).

    Raises:
        APIError: 400 for more than one constraint, when xgrammar rejects it, or as
            :func:`structured_outputs_grammar`.
    """
    found = []
    if json_schema is not None:
        found.append(GrammarSpec("json_object") if json_schema == _ANY_JSON else GrammarSpec("json_schema",
                                                                                          json_schema))
    if regex is not None:
        found.append(GrammarSpec("regex", regex))
    if ebnf is not None:
        found.append(GrammarSpec("ebnf", ebnf))
    if (g := structured_outputs_grammar(so)) is not None:
        found.append(g)
    spec = _one(found, "json_schema, regex, ebnf and structured_outputs", "sampling_params")
    return await checked(spec, "structured_outputs" if so is not None else "sampling_params")


async def checked(spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
    """``spec`` once xgrammar has parsed it (on a worker thread: a large schema takes milliseconds).

    Raises:
        APIError: 400 with xgrammar's message when it rejects the grammar (``param`` names the request field).
    """
    if spec is None:
        return None
    try:
        await asyncio.to_thread(build_grammar, spec)
    except GrammarError as e:
        raise APIError(400, f"invalid {spec.type.replace('_', ' ')}: {e}", param=param) from None
    return spec
