"""Structured outputs in each protocol's terms, turned into the one :class:`~epdserve.wire.messages.GrammarSpec`
the stages take (``SamplingParams.grammar``), and checked with xgrammar before any stage sees the request.

- OpenAI chat: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}`` (``strict`` or not, the output follows the schema: xgrammar's strict mode).
- vLLM (chat and completions): ``structured_outputs`` with one of ``json`` (a schema, object or text),
  ``regex``, ``choice`` (a list of strings, as an EBNF alternation), ``grammar`` (EBNF) or ``json_object``.
- SGLang ``/generate``: ``sampling_params`` ``json_schema`` (text; ``"$$ANY$$"``: any JSON object), ``regex`` or
  ``ebnf``.

Two constraints on one request get a 400, as does anything xgrammar rejects (its message). Tool calling's grammar
(``tool_choice`` required or a named function, a ``structural_tag``) is built by :mod:`epdserve.frontend.openai.tools` and
checked with :func:`checked` here.
"""

from __future__ import annotations

import asyncio
import json

from epdserve.engine.grammar import GrammarError, build_grammar
from epdserve.frontend.errors import APIError
from epdserve.frontend.openai.response_format import ResponseFormat, StructuredOutputs
from epdserve.wire.messages import GrammarSpec

_ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for any JSON object


def _one(found: list[GrammarSpec], what: str, param: str) -> GrammarSpec | None:
    if len(found) > 1:
        raise APIError(400, f"give only one of {what}", param=param)
    return found[0] if found else None


def _schema_text(schema: dict | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)


def _choice_ebnf(choice: list[str]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are also xgrammar's EBNF string escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


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
    return GrammarSpec("json_schema", _schema_text(fmt.json_schema.schema_))


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
        found.append(GrammarSpec("json_schema", _schema_text(so.json_)))
    if so.regex is not None:
        found.append(GrammarSpec("regex", so.regex))
    if so.choice is not None:
        found.append(GrammarSpec("ebnf", _choice_ebnf(so.choice)))
    if so.grammar is not None:
        found.append(GrammarSpec("ebnf", so.grammar))
    if so.json_object:
        found.append(GrammarSpec("json_object"))
    return _one(found, "structured_outputs' json, regex, choice, grammar and json_object", "structured_outputs")


async def chat_grammar(fmt: ResponseFormat | None, so: StructuredOutputs | None) -> GrammarSpec | None:
    """A chat request's grammar from ``response_format`` or ``structured_outputs``, checked (:func:`checked`).

    Raises:
        APIError: 400 when both constrain the output, when xgrammar rejects it, or as the two functions above.
    """
    rf, sg = response_format_grammar(fmt), structured_outputs_grammar(so)
    if rf is not None and sg is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="response_format")
    return await checked(rf, "response_format") if rf is not None else await checked(sg, "structured_outputs")


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
