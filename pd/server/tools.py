"""Tool calls (chat `tools` and `tool_choice`) in the Hermes format Qwen's templates
teach: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.

- `tool_choice: "none"`: the tools are shown to the model; its text is the answer.
- `"auto"` (the default with tools): the text before the first `<tool_call>` is the
  content and each well-formed block a tool call; a block that is not one (bad JSON, no
  name) leaves the whole text as content.
- `"required"`, or a named function: a grammar makes the model write calls (of that
  function; one unless `parallel_tool_calls`), their arguments following its schema.

The template must show the tools to the model (`ChatTemplate.renders_tools`); the server
refuses tools otherwise, never running a request that would ignore them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pd.server.protocol import ChatCompletionRequest, NamedToolChoice, RequestError
from pd.structured.grammar import JSON_LAYOUT, Grammar, GrammarError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolUse:
    """How an answer is read: `parse` its tool calls (tool_choice other than "none");
    `named` (a named function: the finish reason stays "stop", as OpenAI answers)."""

    parse: bool = False
    named: bool = False


def request_tools(body: ChatCompletionRequest, renders_tools: bool, tags_are_tokens: bool,
                  check: Callable[[Grammar], None]) -> tuple[list[dict[str, Any]] | None, ToolUse, Grammar | None]:
    """The request's tools as the template reads them, how its answer is read, and the
    grammar its tool_choice imposes (held to `check`, which raises GrammarError: checker.py);
    RequestError for tools the template cannot show, a tool_choice without tools or naming
    none of them, or parameters that cannot be enforced."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None, ToolUse(), None
    if not renders_tools:
        raise RequestError("this model's chat template does not show tools to the model", param="tools",
                           code="unsupported")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) < len(names):
        raise RequestError("tools name a function twice", param="tools")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in names:
        raise RequestError(f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    grammar = None
    if choice == "required" or named is not None:
        grammar = tool_grammar(tools, named, body.parallel_tool_calls and named is None, tags_are_tokens)
        try:
            check(grammar)
        except GrammarError as e:
            raise RequestError(f"the tools' parameters cannot be enforced: {e}", param="tools",
                               code="invalid_grammar") from None
    return tools, ToolUse(parse=choice != "none", named=named is not None), grammar


def tool_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool, tags_are_tokens: bool) -> Grammar:
    """The grammar of one call (or several, `parallel`) of the tools, or of the function
    `name`; `tags_are_tokens`: the tokenizer has <tool_call> and </tool_call> as tokens
    of their own (the grammar then names those tokens)."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    calls = {"anyOf": [{"type": "object",
                        "properties": {"name": {"const": f["name"]},
                                       "arguments": f.get("parameters") or {"type": "object"}},
                        "required": ["name", "arguments"], "additionalProperties": False} for f in functions],
             "x-guidance": JSON_LAYOUT}
    open_tag, close_tag = (OPEN, CLOSE) if tags_are_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return Grammar("lark", f'{start}\ncall: {open_tag} "\\n" %json {json.dumps(calls)} "\\n" {close_tag}\n')


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an answer: the text before the first <tool_call> (None if
    empty) and the calls of the blocks after it, up to the first block that is not a
    call (an unclosed last block counts); with no call, the whole text is the content."""
    start = text.find(OPEN)
    calls = _leading_calls(BLOCK.finditer(text, start)) if start >= 0 else []
    if not calls:
        return text, []
    return text[:start] or None, calls


def _leading_calls(blocks: Iterator[re.Match[str]]) -> list[dict[str, Any]]:
    calls = []
    for block in blocks:
        call = _call(block.group(1))
        if call is None:
            break
        calls.append(call)
    return calls


def _call(block: str) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}


CLOSED_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCallStream:
    """An answer's tool calls as its text streams in: `feed` each piece of text, then
    `finish`; each returns the content to send now and the calls completed since, so
    that what is sent adds up to `parse_tool_calls` of the whole text. Content stops
    where a <tool_call> begins (text that may be its start waits); a call goes out once
    its block is closed."""

    text: str = ""
    content_sent: int = 0
    calls_sent: int = 0

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        start = self.text.find(OPEN)
        if start < 0:  # hold back a suffix that could be the tag's beginning
            held = next((k for k in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                         if OPEN.startswith(self.text[-k:])), 0)
            return self._content(len(self.text) - held), []
        return self._content(start), self._new(_leading_calls(CLOSED_BLOCK.finditer(self.text, start)))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_tool_calls(self.text)
        if not calls:  # no call after all: the text held back is content
            return self._content(len(self.text)), []
        return "", self._new(calls)

    def _content(self, end: int) -> str:
        piece, self.content_sent = self.text[self.content_sent:end], max(self.content_sent, end)
        return piece

    def _new(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        new = calls[self.calls_sent:]
        self.calls_sent = max(self.calls_sent, len(calls))
        return new
