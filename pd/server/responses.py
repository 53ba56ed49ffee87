"""The choices of an answer, as completions and chat spell them, whole or chunk by chunk.

An answer's choices are the request's sequences (with best_of, the n of them with the
highest cumulative logprob, in that order), each with its text, finish reason, logprobs
when asked for, and token ids when `return_token_ids` is set. Completions with `echo`
put the prompt before the text (and, with logprobs, its tokens before the rest: the
first unscored, the others with the prompt's logprobs); streamed, that goes in the
choice's first chunk. A chat answer read for tool calls (pd/server/tools.py) splits its
text into content and `tool_calls` (streamed: each call in a delta of its own once its
block is complete), and finishes with "tool_calls" when it made any (but for a named
function, as OpenAI answers).
"""

from __future__ import annotations

from typing import Any

from pd.logprobs import Logprobs
from pd.server.generation import Delta, Generation, Sequence
from pd.server.openai_logprobs import CompletionLogprobs, chat_logprobs
from pd.server.tools import ToolCallStream, parse_tool_calls


class Shape:
    """How completions spell an answer (OpenAI's text_completion objects)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    opens_with_role = False

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: Any,
               tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: Any,
                     tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        return self.choice(index, text, finish_reason, logprobs, tool_calls)

    def logprobs(self, answer: Answer, index: int, rows: Logprobs | None, unscored: list[int]) -> Any:
        return answer.completion_logprobs(index).build(rows, unscored)


class ChatShape(Shape):
    """How chat spells an answer (OpenAI's chat.completion objects)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    opens_with_role = True

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: Any,
               tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: Any,
                     tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def role_choice(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def logprobs(self, answer: Answer, index: int, rows: Logprobs | None, unscored: list[int]) -> Any:
        return chat_logprobs(answer.token_strings, rows)


COMPLETION, CHAT = Shape(), ChatShape()


class Answer:
    """One generation's choices in one endpoint's shape."""

    def __init__(self, shape: Shape, generation: Generation, token_strings: Any) -> None:
        self.shape = shape
        self.generation = generation
        self.prepared = generation.prepared
        self.token_strings = token_strings
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._started: set[int] = set()  # choices whose first chunk went out
        self._tool_calls: dict[int, ToolCallStream] = {}

    def completion_logprobs(self, index: int) -> CompletionLogprobs:
        logprobs = self._logprobs.get(index)
        if logprobs is None:
            logprobs = self._logprobs[index] = CompletionLogprobs(self.token_strings)
            if self.prepared.resumed is not None:  # offsets run on from what the client was shown
                shown = self.prepared.resumed.choices[index].shown_token_ids
                logprobs.text_offset = sum(map(len, self.token_strings(shown)))
        return logprobs

    @property
    def opens_with_role(self) -> bool:
        """Whether the stream opens with each choice's role (chat's, unless resumed: it was sent)."""
        return self.shape.opens_with_role and self.prepared.resumed is None

    def choices(self) -> list[dict[str, Any]]:
        """Every choice, whole (after the generation finished)."""
        sequences = self.generation.sequences
        if len(sequences) > self.prepared.n:  # best_of: the most likely n
            sequences = sorted(sequences, key=lambda s: -s.cumulative_logprob)[:self.prepared.n]
        return [self._choice(i, sequence) for i, sequence in enumerate(sequences)]

    def _choice(self, index: int, sequence: Sequence) -> dict[str, Any]:
        delta = Delta(sequence.text, sequence.token_ids, sequence.finish_reason, index, sequence.logprobs)
        text, logprobs = self._text_and_logprobs(index, delta, first=True)
        tool_calls: list[dict[str, Any]] = []
        if self.prepared.tool_use.parse:
            text, tool_calls = parse_tool_calls(text)
        choice = self.shape.choice(index, text, self._finish_reason(delta.finish_reason, tool_calls), logprobs,
                                   tool_calls)
        return self._with_token_ids(choice, delta, whole=True)

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        """The choice of one streamed delta (the first of each choice carries the echo);
        None when it has nothing to send (text held back to read tool calls)."""
        first = delta.index not in self._started
        self._started.add(delta.index)
        text, logprobs = self._text_and_logprobs(delta.index, delta, first)
        tool_calls: list[dict[str, Any]] = []
        if self.prepared.tool_use.parse:
            text, tool_calls = self._stream_tool_calls(delta)
        finish_reason = self._finish_reason(delta.finish_reason, self._tool_calls.get(delta.index))
        if not (text or tool_calls or finish_reason or logprobs or delta.token_ids):
            return None
        choice = self.shape.chunk_choice(delta.index, text, finish_reason, logprobs, tool_calls)
        return self._with_token_ids(choice, delta, whole=False)

    def role_chunk_choices(self) -> list[dict[str, Any]]:
        """Chat streams open with each choice's role."""
        token_ids = {"token_ids": []} if self.prepared.return_token_ids else {}
        return [self.shape.role_choice(i) | token_ids for i in range(self.prepared.n)]

    def _text_and_logprobs(self, index: int, delta: Delta, first: bool) -> tuple[str, Any]:
        text, rows = delta.text, delta.logprobs
        if self.prepared.drop_output:
            text, rows = "", None
        echo = self.prepared.echo if first else None
        unscored: list[int] = []
        if echo is not None:
            text = echo.text + text
            prompt_rows = self.generation.prompt_logprobs
            if self.prepared.logprobs is not None and prompt_rows is not None:
                unscored = echo.token_ids[:1]
                rows = _joined(prompt_rows, rows)
        if self.prepared.logprobs is None:
            return text, None
        return text, self.shape.logprobs(self, index, rows, unscored)

    def _stream_tool_calls(self, delta: Delta) -> tuple[str, list[dict[str, Any]]]:
        stream = self._tool_calls.setdefault(delta.index, ToolCallStream())
        sent_before = stream.calls_sent
        text, calls = stream.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = stream.finish()
            text, calls = text + rest, calls + more
        return text, [{"index": sent_before + i} | call for i, call in enumerate(calls)]

    def _finish_reason(self, reason: str | None, calls: list[dict[str, Any]] | ToolCallStream | None) -> str | None:
        made_calls = calls.calls_sent if isinstance(calls, ToolCallStream) else calls
        if reason != "stop" or not made_calls or self.prepared.tool_use.named:
            return reason
        return "tool_calls"

    def _with_token_ids(self, choice: dict[str, Any], delta: Delta, whole: bool) -> dict[str, Any]:
        """With `return_token_ids`: the choice's token ids, and with logprobs each scored
        token's row by id (`top_token_ids`: [id, logprob] of the token, then of the k most
        likely; the logprobs objects name tokens by text, which two tokens may share)."""
        if self.prepared.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if delta.logprobs is not None:
                rows = delta.logprobs
                choice["top_token_ids"] = [[[t, v] for t, v in zip(ids, values)]
                                           for ids, values in zip(rows.token_ids, rows.logprobs)]
            if whole:
                choice["prompt_token_ids"] = list(self.prepared.engine_request.prompt_token_ids)
        return choice


def _joined(first: Logprobs, then: Logprobs | None) -> Logprobs:
    rows = first.rows(0)
    if then is not None:
        rows.append(then)
    return rows
