"""What of a client's grammar may reach llguidance (native code, see checker.py): bounds
on its size and on what makes its compiler recurse, each refused with a message naming
the limit (the server answers 400 `invalid_grammar`).

- `MAX_GRAMMAR_CHARS`: the grammar's text (a JSON schema as JSON, a regex, a Lark
  grammar, a choice list) and a tool call grammar made of the request's tools;
- `MAX_LARK_RULES`: rule definitions in a Lark grammar (a chain of ~2,750 overflowed an
  8 MiB stack);
- `MAX_SCHEMA_DEPTH`: nesting of a JSON schema's objects and arrays;
- `MAX_SCHEMA_REFS`: `$ref`s in a JSON schema (a chain of ~2,500 overflowed 8 MiB).

Real schemas and grammars are far inside these bounds; llguidance's own limits (its
lexer and parser fuel) bound the work per token once compiled.
"""

from __future__ import annotations

import json
import re

from pd.structured.grammar import Grammar, GrammarError

MAX_GRAMMAR_CHARS = 256 * 1024
MAX_LARK_RULES = 1000
MAX_SCHEMA_DEPTH = 128
MAX_SCHEMA_REFS = 1000
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.]*[ \t]*:", re.MULTILINE)


def check_limits(grammar: Grammar) -> None:
    """GrammarError naming the limit the grammar is past, if any."""
    if len(grammar.value) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar has {len(grammar.value)} characters, more than this server's limit "
                           f"of {MAX_GRAMMAR_CHARS}")
    if grammar.kind == "lark":
        rules = len(_LARK_RULE.findall(grammar.value))
        if rules > MAX_LARK_RULES:
            raise GrammarError(f"the grammar defines {rules} rules, more than this server's limit of "
                               f"{MAX_LARK_RULES}")
    elif grammar.kind == "json_schema":
        _check_schema(grammar.value)


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        raise GrammarError(f"the JSON schema is not JSON, or nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    depth, refs = _measure(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the JSON schema nests {depth} levels deep, more than this server's limit of "
                           f"{MAX_SCHEMA_DEPTH}")
    if refs > MAX_SCHEMA_REFS:
        raise GrammarError(f"the JSON schema has {refs} $refs, more than this server's limit of {MAX_SCHEMA_REFS}")


def _measure(value: object) -> tuple[int, int]:
    """(deepest nesting of objects and arrays, number of "$ref" keys), without recursion."""
    deepest, refs = 0, 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            refs += "$ref" in node
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest, refs
