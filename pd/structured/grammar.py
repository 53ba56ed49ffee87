"""The grammar a request's output must follow, as the server hands it to the engine.

Kinds: a JSON schema (`json_schema`, its text), any JSON object (`json_object`), a
regular expression (`regex`), one of given strings (`choice`, a JSON list of them), or a
Lark grammar (`lark`). llguidance compiles each; `check` asks it whether it can (without
a tokenizer, so the server can refuse a bad grammar before any engine work).

JSON is generated as `json.dumps` writes it, `", "` between items and `": "` after keys
and no other whitespace: llguidance would otherwise allow any whitespace between tokens,
and a small model can spend its whole budget on it. A schema's own `x-guidance` options
(llguidance's) override that.
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
ANY_JSON_OBJECT = '{"type": "object"}'
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (or enforce)."""


class Grammar(msgspec.Struct, frozen=True):
    kind: GrammarKind
    value: str = ""

    def llguidance(self) -> str:
        """The grammar in llguidance's own (JSON) form."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.value if self.kind == "json_schema" else ANY_JSON_OBJECT, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        return llguidance.grammar_from(self.kind, self.value)

    def check(self) -> None:
        """GrammarError saying why llguidance cannot compile it."""
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(self.llguidance())
        except Exception as e:  # a schema or grammar it cannot even read
            raise GrammarError(str(e)) from None
        if error:
            raise GrammarError(error)


def choice_grammar(choices: list[str]) -> Grammar:
    return Grammar("choice", json.dumps(choices))
