"""The OpenAI request bodies the server accepts, and the one error shape it answers with.

Bodies are parsed from raw JSON in strict mode (no "5" for 5, no 1.0 for a count), so a
wrong type is a 400 that names the field, never FastAPI's 422. Fields OpenAI defines but
this server does not implement are declared only to be refused by name, and a top-level
field the server does not know at all (another server's `typical_p`, `guided_json`,
`guided_regex`, `tool_choice`, ...) is refused the same way: a server that ignored it
would answer as if it had applied it. Only fields that cannot change an answer
(IGNORED_FIELDS) pass unread.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from wire.errors import INVALID_REQUEST_ERROR, ApiError


class RequestError(ApiError):
    """A request this server refuses; rendered as OpenAI's `{"error": {...}}` (wire/errors.py)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = INVALID_REQUEST_ERROR,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, code=code, status=status, type=type, param=param, headers=headers)


class _Strict(BaseModel):
    """Strict types; unknown fields are ignored (clients send extras we need not read)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ResumedChoice(_Strict):
    """One choice of a resumed stream: the tokens it generated on the other server, the
    characters of its text the client has been sent (a server holds back text that may
    begin a stop string or end inside a character), and its finish reason if it had
    ended there (nothing more is generated for it). `kv_transfer_params`: where the KV
    of its prompt and every token but its last is kept for this server to read (a
    draining server handed it on, pd/server/resume.py); absent, it is computed here."""

    token_ids: list[int]
    text_chars: int = 0
    finish_reason: Literal["stop", "length"] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class Resume(_Strict):
    """A stream taken up where another server left it (the proxy's migration,
    proxy/migration.py): each of its `n` choices, in order."""

    choices: list[ResumedChoice]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Top-level fields accepted and not read: bookkeeping that cannot change an answer.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier"})


class SamplingFields(_Strict):
    """What completions and chat share: the model, sampling, stopping and PD fields.
    Fields it does not declare are kept (`model_extra`) for `refuse_unsupported`."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extra
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extra
    ignore_eos: bool = False  # extra
    min_tokens: int | None = None  # extra
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # extra (PD)
    cache_salt: str | None = None  # extra
    return_token_ids: bool = False  # extra: output token ids in each choice / chunk (prompt's too, unstreamed)
    resume: Resume | None = None  # extra (PD migration): the stream so far, generated elsewhere
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's) -> bias in [-100, 100]
    min_p: float | None = None  # extra
    presence_penalty: float | None = None  # [-2, 2]
    frequency_penalty: float | None = None  # [-2, 2]
    repetition_penalty: float | None = None  # extra; (0, 2]
    best_of: int | None = None
    # structured outputs (pd/server/structured.py reads them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # extra (vLLM's)
    guided_json: dict[str, Any] | str | None = None  # extra (vLLM's older names)
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk of the stream (vLLM's `continuous_usage_stats`)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_shown(self) -> int | None:
        """Alternatives to show per token (0: the token's own logprob); None: no logprobs."""
        return None


class CompletionRequest(SamplingFields):
    # Optional here so that a missing prompt is refused by the server with its own message.
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None  # declared to be refused when used

    @property
    def logprobs_shown(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A message; `content` may be null only in an assistant message with tool calls."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # extra
    chat_template_kwargs: dict[str, Any] | None = None  # extra
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_shown(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The validated body; RequestError naming the first bad field otherwise."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as e:
        raise _to_request_error(e) from None


# What a union-typed field expects, for a message better than its first branch's error.
_UNION_EXPECTS = {
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def _to_request_error(e: ValidationError) -> RequestError:
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        return RequestError(f"the body must be a JSON object: {first['msg']}", code="invalid_body")
    path = [str(part) for part in first["loc"]]
    # Union branches add their type name to loc ("prompt", "str"); cut the path there.
    branch = next((i for i, part in enumerate(path) if _is_union_branch(part)), None)
    if branch is not None:
        param = ".".join(path[:branch])
        expects = _UNION_EXPECTS.get(path[branch - 1], "another type")
        return RequestError(f"{param} must be {expects}", param=param, code="invalid_type")
    param = ".".join(path)
    return RequestError(f"{param}: {first['msg']}", param=param, code="invalid_type")


def _is_union_branch(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or "[" in part or part[:1].isupper()


def refuse_unsupported(body: SamplingFields) -> None:
    """RequestError for a field this server does not implement."""
    unsupported: list[tuple[str, bool]] = []
    if isinstance(body, CompletionRequest):
        unsupported += [("suffix", body.suffix is not None)]
    unsupported += [(name, True) for name in sorted(body.model_extra or {}) if name not in IGNORED_FIELDS]
    for name, used in unsupported:
        if used:
            raise RequestError(f"{name} is not supported by this server", param=name, code="unsupported")

