"""The structured-output fields of a request, as one grammar for the engine.

Accepted, on completions and chat alike:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or its text),
  `regex`, `choice` (a list of strings), `grammar` (Lark), `json_object: true`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

One constraint per request. Any other kind, or a grammar llguidance cannot compile (or
enforce: a JSON schema keyword it does not implement), is a 400 naming the field, never
a request that runs unconstrained.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pd.server.protocol import RequestError, SamplingFields
from pd.structured.grammar import Grammar, GrammarError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def request_grammar(body: SamplingFields, check: Callable[[Grammar], None]) -> Grammar | None:
    """The request's grammar, or None; RequestError otherwise (`check` raises GrammarError
    for a grammar that cannot be enforced: checker.py)."""
    found: list[tuple[str, Grammar]] = []
    if body.response_format is not None:
        grammar = _response_format(body.response_format)
        if grammar is not None:
            found.append(("response_format", grammar))
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, _grammar(kind, value, name)))
    if not found:
        return None
    if len(found) > 1:
        raise RequestError(f"a request takes one structured-output constraint; it has {found[0][0]} and "
                           f"{found[1][0]}", param=found[1][0])
    param, grammar = found[0]
    try:
        check(grammar)
    except GrammarError as e:
        raise RequestError(f"{param} cannot be enforced: {e}", param=param, code="invalid_grammar") from None
    return grammar


def _response_format(value: dict[str, Any]) -> Grammar | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                               param="response_format.json_schema")
        return Grammar("json_schema", json.dumps(schema))
    raise RequestError(f"response_format type {kind!r} is not supported by this server (text, json_object and "
                       "json_schema are)", param="response_format.type", code="unsupported")


def _structured_outputs(value: dict[str, Any]) -> list[tuple[str, Grammar]]:
    unknown = sorted(set(value) - set(STRUCTURED_KINDS))
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]} is not supported by this server (one of "
                           f"{', '.join(STRUCTURED_KINDS)} is)", param=f"structured_outputs.{unknown[0]}",
                           code="unsupported")
    found = []
    for kind in STRUCTURED_KINDS:
        param = f"structured_outputs.{kind}"
        if kind == "json_object":
            if value.get(kind) not in (None, False, True):
                raise RequestError(f"{param} must be a boolean", param=param)
            if value.get(kind):
                found.append((param, Grammar("json_object")))
        elif value.get(kind) is not None:
            found.append((param, _grammar(kind, value[kind], param)))
    return found


def _grammar(kind: str, value: Any, param: str) -> Grammar:
    """A `json` / `regex` / `choice` / `grammar` constraint's grammar."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise RequestError(f"{param} must be a JSON schema (an object, or its text)", param=param) from None
        if not isinstance(value, dict):
            raise RequestError(f"{param} must be a JSON schema (an object, or its text)", param=param)
        return Grammar("json_schema", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
        return Grammar("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string", param=param)
    return Grammar("regex" if kind == "regex" else "lark", value)


def one_grammar(requested: Grammar | None, tools: Grammar | None) -> Grammar | None:
    """The request's grammar: its structured-output one or the one its tool_choice makes
    ("required" or a named function), not both."""
    if requested is not None and tools is not None:
        raise RequestError("tool_choice required or a named function decides the output's form; it cannot be "
                           "combined with a structured-output constraint", param="tool_choice")
    return requested or tools
