"""A request's grammar checked without a tokenizer: what the gateway runs on every structured request (the
prefill and decode servers compile against their tokenizer in :mod:`epdserve.engine.grammar`).

No torch here: the gateway imports this at start-up and would otherwise wait seconds for torch (issue 43);
xgrammar, which does import torch, is imported on first use.
"""

from __future__ import annotations

import re
from typing import Any

from epdserve.wire.messages import GrammarSpec

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; clients get the message after it.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


# xgrammar 0.2 writes the characters of a string with minLength/maxLength as [^"\\\r\n], which lets raw control
# characters (U+0000-U+001F) through: JSON forbids them in strings (json.loads refuses the output). Such strings get
# JSON's own class instead (no escapes either way: the bounded rule counts characters).
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


class GrammarError(ValueError):
    """xgrammar rejected a grammar (a schema it does not support, a regex or EBNF that does not parse)."""


def library_message(e: Exception) -> str:
    """xgrammar's error message without its C++ source location (what a client is shown)."""
    return _CPP_PREFIX.sub("", str(e).strip()).strip()


def build_grammar(spec: GrammarSpec) -> Any:
    """``spec`` as an ``xgrammar.Grammar`` (no tokenizer needed: this is the check the gateway runs).

    JSON is compact (``any_whitespace=False``: ``", "`` and ``": "`` separators, no other whitespace), so a model
    cannot spend its whole budget on whitespace, and xgrammar's ``strict_mode`` forbids properties and items the
    schema does not name, so every output validates against the schema. ``structural_tag``: xgrammar's
    structural-tag JSON (``{"type": "structural_tag", "format": ...}``), e.g. the tool calls of
    :mod:`epdserve.frontend.openai.tools`.

    Raises:
        GrammarError: xgrammar rejects it (its message, see :func:`library_message`), or an unknown kind.
    """
    import xgrammar as xgr

    try:
        if spec.type == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            ebnf = str(grammar)
            if _LOOSE_STRING_CHARS in ebnf:
                grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS))
            return grammar
        if spec.type == "json_object":
            # Any JSON object (OpenAI's json_object mode): the schema of an object with any properties.
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.type == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.type == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.type == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError for C++ parse errors
        raise GrammarError(library_message(e)) from None
    raise GrammarError(f"unknown grammar kind {spec.type!r}")
