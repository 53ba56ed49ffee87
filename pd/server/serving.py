"""From a parsed OpenAI body to an engine request.

`Server.prepare_*` validate a body against the model (prompt length, vocabulary,
sampling ranges) and build the `EngineRequest` and what the response needs besides
(`Prepared`); `generation.py` runs it. Neither knows about HTTP; `app.py` shapes what
they produce into responses.
"""

from __future__ import annotations

import hmac
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from pd.contracts.sampling_params import SamplingParams
from pd.engine.ipc_messages import EngineRequest
from pd.kv_transfer.connectors import NULL_CONNECTOR
from pd.kv_transfer.params import RemoteDecodeParams, RemotePrefillParams, TransferParamsError, parse_transfer_params
from pd.kv_transfer.signing import DEFAULT_ALLOWED_PEERS, TransferParamsGuard, TransferParamsRefused, UntilExpiry
from pd.server.chat import ChatTemplate, ChatTemplateError
from pd.server.limits import DEFAULT_LIMITS, RequestLimits
from pd.server.off_loop import OffLoop, TooManyWaiting
from pd.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestError,
    ResumedChoice,
    SamplingFields,
    refuse_unsupported,
)
from pd.server.resume import Resumed, migrated_kv, resume_stream
from pd.server.sampling import SamplingChecker, check_vocab
from pd.server.structured import one_grammar, request_grammar
from pd.server.tools import CLOSE, OPEN, ToolUse, request_tools
from pd.structured.checker import GrammarChecker
from pd.structured.grammar import Grammar
from wire.headers import REQUEST_ID, retry_after
from wire.kv_params import KV_TRANSFER_PARAMS, PREFIX, SIGNATURE

# A token's text is at most `tokenizer.max_token_chars` characters, so a text longer than
# that times the context cannot fit; the slack covers normalizers that merge characters.
CHARS_PER_TOKEN_SLACK = 4
# A text longer than this many characters per token of the context has its start tokenized
# first: past the context (with a margin for the token the cut splits) it is refused there.
PEEK_CHARS_PER_TOKEN = 8
PEEK_MARGIN_TOKENS = 16
PREPARE_THREADS = max(2, os.cpu_count() or 2)  # requests prepared at once, off the event loop
GRAMMAR_WAITERS = 32  # requests waiting for the grammar checker at once (off_loop.py); past it, 503
T = TypeVar("T")


@dataclass
class Prepared:
    """A validated request: what to send to the engine and how to treat its output.
    `request_id` is the id the client sees (its X-Request-Id, or a new one); the engine
    request's id is unique to this request, so that two requests sharing a client id
    (P and D on one server) never meet in the engine."""

    request_id: str
    engine_request: EngineRequest
    stop: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    release_first: str | None = None  # blocks this server keeps for the request, to free before it runs
    n: int = 1  # choices answered; with best_of, the most likely n of the engine request's sequences
    logprobs: int | None = None  # alternatives shown per token; None: no logprobs in the answer
    echo: Echo | None = None  # the prompt, answered before each choice's text (completions)
    drop_output: bool = False  # echo with max_tokens=0: the one token computed is not answered
    tool_use: ToolUse = ToolUse()  # how a chat answer's tool calls are read
    continuous_usage: bool = False  # usage in every streamed chunk
    resumed: Resumed | None = None  # a stream taken up from another server

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)


@dataclass(frozen=True)
class Echo:
    """The prompt as `echo` answers it: its text and its token ids (with logprobs, the
    first is shown unscored and the rest with the prompt's logprobs)."""

    text: str
    token_ids: list[int]


class Server:
    """The model-facing half of the app: one tokenizer, one engine, one model name."""

    def __init__(self, client: Any, tokenizer: Any, served_model_name: str, chat_template: ChatTemplate,
                 role: str = "both", transfer_guard: TransferParamsGuard | None = None,
                 limits: RequestLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.client = client
        self.role = role
        self.transfer_guard = transfer_guard or TransferParamsGuard(None, DEFAULT_ALLOWED_PEERS)
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        self.in_flight: set[str] = set()
        self.migratable: dict[str, str] = {}  # streams the proxy may take elsewhere: request id -> engine's id
        self.draining = False  # takes no new request (pd serve on SIGTERM, main.py)
        self.held = UntilExpiry()  # engine request ids of params answered, until their lease ends
        self.grammars = GrammarChecker()  # llguidance runs in a process of its own: a grammar may crash it
        self._off_loop = OffLoop(PREPARE_THREADS, GRAMMAR_WAITERS)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work()` (parsing, templates, tokenizing, grammar checks) in a worker thread, at
        most PREPARE_THREADS working at once (off_loop.py): the event loop keeps answering
        (/health, streams) while a large body is read, and the threads of big requests
        cannot crowd it out of the GIL."""
        return await self._off_loop.run(work)

    def check_grammar(self, grammar: Grammar) -> None:
        """GrammarError unless the checker passes `grammar`; waits for it without holding a
        prepare slot."""
        try:
            self._off_loop.waiting(lambda: self.grammars.check(grammar))
        except TooManyWaiting:
            raise RequestError(f"{GRAMMAR_WAITERS} requests wait for the grammar checker already; try again",
                               code="grammar_checker_busy", status=503, type="server_error",
                               headers=retry_after(1)) from None

    async def hand_on(self) -> None:
        """Have the engine hand on every stream the proxy may take elsewhere (a draining
        server): each ends with a `migrated` error event naming its KV. Sent again while
        draining (a stream not yet in the engine is not known to it); idempotent."""
        if self.migratable:
            await self.client.migrate(list(self.migratable.values()))

    @property
    def drained(self) -> bool:
        """Nothing in flight here, and no blocks kept for a decode server to read."""
        held = (self.client.stats.kv_transfer or {}).get("requests_held", 0)
        return not self.in_flight and not held

    def close(self) -> None:
        self.grammars.close()

    def engine_restarted(self) -> None:
        """A new engine serves: the blocks the old one kept are gone with it."""
        self.held = UntilExpiry()

    def note_held(self, params: RemotePrefillParams) -> None:
        """This server answered `params`: its engine keeps their blocks until the lease ends."""
        now = time.time()
        self.held.add(params.remote_request_id, params.lease_expires_at or now, now, params.signature)

    def check_holder(self, remote_request_id: str, signature: str | None) -> None:
        """RequestError 403 unless the caller holds the parameters answered for the request:
        with a deployment secret, their signature (a client cannot free blocks that a decode
        server is to read; the proxy that routed the request has it); without one, their
        request id, which only they were told."""
        expected = self.held.value(remote_request_id)
        if expected is None:
            return  # held by no signed parameters (or not held: nothing to release)
        if signature is None or not hmac.compare_digest(signature, expected):
            raise RequestError("only the holder of the request's kv_transfer_params may release its blocks: send "
                               "their signature", param=SIGNATURE, code="not_the_holder", status=403,
                               type="permission_error")

    async def release_held(self, remote_request_id: str) -> bool:
        """Have the engine free now the blocks kept for `remote_request_id`; False if this
        server holds none for it (never answered, already read, or the lease ended)."""
        if not self.held.pop(remote_request_id, time.time()):
            return False
        await self.client.release_held([remote_request_id])
        return True

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size

    def request_id(self, header: str | None, prefix: str) -> str:
        """The incoming X-Request-Id if given (it must not be in flight), else a new id."""
        if header is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not header or len(header) > 256 or not header.isprintable():
            raise RequestError("X-Request-Id must be 1 to 256 printable characters", param=REQUEST_ID)
        self._check_not_in_flight(header)
        return header

    def claim(self, request_id: str) -> None:
        """Mark the request in flight (checked again: it was prepared off the event loop)."""
        self._check_not_in_flight(request_id)
        self.in_flight.add(request_id)

    def _check_not_in_flight(self, request_id: str) -> None:
        if request_id in self.in_flight:
            raise RequestError(f"request id {request_id!r} is already in flight", param=REQUEST_ID,
                               code="duplicate_request_id")

    def prepare_completion(self, body: CompletionRequest, request_id: str) -> Prepared:
        self._check_common(body)
        ids = self._completion_prompt(body.prompt)
        echo = None
        if body.echo:
            one_text = isinstance(body.prompt, list) and isinstance(body.prompt[0], str)
            prompt = body.prompt[0] if one_text else body.prompt
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
            echo = Echo(text, ids)
        prepared = self._prepare(body, request_id, ids, "prompt", echo=echo)
        if prepared.resumed is None:  # a resumed stream's echo went out with its first chunk
            prepared.echo = echo
        return prepared

    def prepare_chat(self, body: ChatCompletionRequest, request_id: str) -> Prepared:
        self._check_common(body)
        ids, tool_use, tool_grammar = self._chat_prompt(body)
        if body.resume is not None and tool_use.parse:
            raise RequestError("a stream read for tool calls cannot be resumed", param="resume", code="unsupported")
        prepared = self._prepare(body, request_id, ids, "messages", tool_grammar)
        prepared.tool_use = tool_use
        return prepared

    def tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The token ids the engine would get for the request's prompt (or messages)."""
        if isinstance(body, ChatCompletionRequest):
            return self._chat_prompt(body)[0]
        return self._completion_prompt(body.prompt)

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], ToolUse, Grammar | None]:
        """The rendered conversation's token ids, how the answer is read for tool calls,
        and the grammar the tool choice imposes."""
        if not body.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        for param in ("tools", "chat_template_kwargs"):  # rendered into the prompt too
            if getattr(body, param):
                self._check_chars(len(body.model_dump_json(include={param})), param)
        tags_are_tokens = all(self.tokenizer.token_id(tag) is not None for tag in (OPEN, CLOSE))
        tools, tool_use, tool_grammar = request_tools(body, self.chat_template.renders_tools, tags_are_tokens,
                                                      self.check_grammar)
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt, body.chat_template_kwargs, tools)
        except ChatTemplateError as e:
            raise RequestError(str(e), param="messages") from None
        self._check_chars(len(text), "messages")  # as rendered: a template may repeat what it is given
        return self._encode(text, "messages", add_special_tokens=False), tool_use, tool_grammar

    def _check_common(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.served_model_name:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves "
                               f"{self.served_model_name!r}", param="model", code="model_not_found", status=404)
        refuse_unsupported(body)

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if prompt is None:
            raise RequestError("prompt is required", param="prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise RequestError("only one prompt per request is supported", param="prompt", code="unsupported")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            return self._encode(prompt, "prompt") if prompt else []
        check_vocab(self.vocab_size, prompt, "prompt")
        return list(prompt)

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context whatever its
        tokens (tokenizing megabytes would take the server's CPU for seconds)."""
        limit = CHARS_PER_TOKEN_SLACK * self.tokenizer.max_token_chars * self.max_model_len
        if num_chars > limit:
            raise RequestError(f"the {param} has {num_chars} characters, more than any text of "
                               f"{self.max_model_len} tokens (this model's context) can have",
                               param=param, code="context_length_exceeded")

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; a text far longer than the context is refused from the
        tokens of its start (PEEK_CHARS_PER_TOKEN characters per token of context), so
        the work a request can ask of the tokenizer is bounded by the context, not by
        the characters it sends."""
        peek = PEEK_CHARS_PER_TOKEN * self.max_model_len
        if len(text) > peek:
            start = len(self.tokenizer.encode(text[:peek], add_special_tokens=add_special_tokens))
            if start > self.max_model_len + PEEK_MARGIN_TOKENS:
                raise RequestError(f"the {param} has more than {self.max_model_len} tokens (its first {peek} "
                                   f"characters alone have {start}); this model's context is {self.max_model_len} "
                                   "tokens, prompt and output together", param=param,
                                   code="context_length_exceeded")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _prepare(self, body: SamplingFields, request_id: str, prompt_ids: list[int], prompt_param: str,
                 tool_grammar: Grammar | None = None, echo: Echo | None = None) -> Prepared:
        if not prompt_ids:
            raise RequestError("the prompt is empty", param=prompt_param)
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                               f"{self.max_model_len} tokens, prompt and output together",
                               param=prompt_param, code="context_length_exceeded")
        sampling = SamplingChecker(self.limits, self.max_model_len, self.vocab_size)
        params = sampling.sampling_params(body, len(prompt_ids), one_grammar(request_grammar(body, self.check_grammar),
                                                                             tool_grammar))
        sampling.check_cost(params, len(prompt_ids))
        if body.cache_salt is not None and not body.cache_salt:
            raise RequestError("cache_salt must be a non-empty string", param="cache_salt")
        stop = body.stop_strings
        if any(not s for s in stop):
            raise RequestError("stop strings must be non-empty", param="stop")
        transfer = self._transfer_params(body.kv_transfer_params, prompt_ids, params)
        release_first = None
        if isinstance(transfer, RemotePrefillParams) and transfer.remote_engine_id == self.client.info.engine_id:
            # Prefilled here: served from this server's own prefix cache (its blocks, once released).
            transfer, release_first = None, transfer.remote_request_id
        elif isinstance(transfer, RemoteDecodeParams) and transfer.prefix is not None \
                and transfer.prefix.remote_engine_id == self.client.info.engine_id:  # a prefix it holds itself
            transfer, release_first = RemoteDecodeParams(do_remote_decode=True), transfer.prefix.remote_request_id
        stream = bool(body.stream)
        if stream and body.best_of not in (None, body.n or 1):
            raise RequestError("best_of cannot be used with stream (the best sequences are known only at "
                               "the end)", param="best_of")
        if isinstance(transfer, RemoteDecodeParams):  # P: prefill and the first token only, answered whole
            # (validated above as D will validate it; min_tokens >= 1 still keeps its one token from stopping it)
            params, stream = msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)), False
        resumed = None
        if body.resume is not None:
            resumed = resume_stream(body.resume, params, transfer, stream, stop, echo, self.tokenizer,
                                    self.vocab_size, lambda j, c: self._migrated_kv(j, c, prompt_ids))
            params = msgspec.structs.replace(params, prompt_logprobs=None)  # the client has them, if it asked
        engine_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        engine_request = EngineRequest.create(engine_id, prompt_ids, params, transfer, body.cache_salt, None if
                                              resumed is None else [None if c.finish_reason else c.token_ids
                                                                    for c in resumed.choices],
                                              None if resumed is None else resumed.kv)
        return Prepared(request_id, engine_request, stop, stream, body.include_usage, body.return_token_ids,
                        release_first, n=body.n or 1, logprobs=body.logprobs_shown,
                        drop_output=body.output_limit == 0, continuous_usage=body.continuous_usage,
                        resumed=resumed)

    def _transfer_params(self, raw: Any, prompt_ids: list[int],
                         params: SamplingParams) -> RemoteDecodeParams | RemotePrefillParams | None:
        """The typed PD parameters; RequestError naming the field that is malformed or
        does not fit the request (400), or saying why this server will not act on them
        (403: unsigned, forged, expired, replayed, issued for another prompt, or naming a
        peer it does not trust)."""
        try:
            transfer = parse_transfer_params(raw)
            if transfer is not None and self.client.info.kv_connector == NULL_CONNECTOR:
                raise RequestError("this server has no KV connector, so it takes no part in prefill/decode "
                                   "disaggregation (start it with --kv-connector nixl, or a --role)",
                                   param=KV_TRANSFER_PARAMS, code="unsupported")
            if isinstance(transfer, RemotePrefillParams):
                transfer.check_request(prompt_ids, params.n, params.logprobs, params.prompt_logprobs, self.vocab_size)
            if isinstance(transfer, RemoteDecodeParams):
                transfer.check_prefix(prompt_ids)
        except TransferParamsError as e:
            raise RequestError(str(e), param=e.field) from None
        if isinstance(transfer, RemotePrefillParams):
            self._guard(transfer, prompt_ids, KV_TRANSFER_PARAMS)
        elif isinstance(transfer, RemoteDecodeParams) and transfer.prefix is not None:  # read from a decode server
            self._guard(transfer.prefix, prompt_ids[:transfer.prefix.num_prompt_tokens],
                        f"{KV_TRANSFER_PARAMS}.{PREFIX}")
        return transfer

    def _migrated_kv(self, index: int, choice: ResumedChoice, prompt_ids: list[int]) -> RemotePrefillParams | None:
        if choice.kv_transfer_params is not None and self.client.info.kv_connector == NULL_CONNECTOR:
            raise RequestError("this server has no KV connector, so it reads no KV handed on by another server",
                               param=f"resume.choices.{index}.kv_transfer_params", code="unsupported")
        return migrated_kv(index, choice, prompt_ids, self.client.info.engine_id, self._guard)

    def _guard(self, params: RemotePrefillParams, prompt_ids: list[int], field: str) -> None:
        """RequestError (403) unless this server may read the KV these parameters name for `prompt_ids`."""
        try:
            self.transfer_guard.check(params, prompt_ids)
        except TransferParamsRefused as e:
            raise RequestError(str(e), param=field, code="kv_transfer_params_refused", status=403,
                               type="permission_error") from None

def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' convention): content a string,
    an assistant's tool calls as {"id", "type", "function": {"name", "arguments"}}."""
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise RequestError(f"messages[{index}].content is required (it may be null only in an assistant "
                           "message with tool_calls)", param=f"messages.{index}.content")
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered
