"""The checkpoint's chat template, rendered as transformers renders it.

The template comes from `chat_template.jinja` in the model directory when present (newer
checkpoints), else from tokenizer_config.json's `chat_template` (a string, or a list of
named templates of which "default" is used). It is rendered in a sandboxed jinja2
environment with `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson`
filter, `raise_exception` and `strftime_now`, and the tokenizer's special tokens as
variables; the result is tokenized without adding special tokens (the template has them).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")


RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template refused it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: unlike jinja2's, it does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """`render(messages)` -> prompt text; `encode(messages)` -> prompt token ids."""

    def __init__(self, source: str | None, tokenizer_config: dict[str, Any]) -> None:
        self.source = source
        self.special_tokens = {key: _token_text(tokenizer_config.get(key)) for key in SPECIAL_TOKEN_KEYS}

    @classmethod
    def from_config(cls, tokenizer_config: dict[str, Any]) -> ChatTemplate:
        return cls(_pick_template(tokenizer_config.get("chat_template")), tokenizer_config)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, tokenizer_config: dict[str, Any]) -> ChatTemplate:
        jinja_file = Path(model_dir) / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), tokenizer_config)
        return cls.from_config(tokenizer_config)

    @cached_property
    def _environment(self) -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.source is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        return self._environment.from_string(self.source)

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template reads `tools` (shows a request's tools to the model)."""
        if self.source is None:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(self._environment.parse(self.source))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text; ChatTemplateError if the template refuses the conversation
        or the extra variables (`template_kwargs`, a client's chat_template_kwargs)."""
        reserved = sorted(RESERVED_VARIABLES & set(template_kwargs or {}))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # the template ran on client data: any failure is the request's
            raise ChatTemplateError(f"the chat template refused the conversation: {type(e).__name__}: {e}") from None

    def encode(self, tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.render(messages, add_generation_prompt, template_kwargs, tools)
        return tokenizer.encode(text, add_special_tokens=False)


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None
