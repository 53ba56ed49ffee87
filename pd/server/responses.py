"""The choices of an answer, as completions and chat spell them, whole or chunk by chunk.

An answer's choices are the request's sequences (with best_of, the n of them with the
highest cumulative logprob, in that order), each with its text, finish reason, logprobs
when asked for, and token ids when `return_token_ids` is set. Completions with `echo`
put the prompt before the text (and, with logprobs, its tokens before the rest: the
first unscored, the others with the prompt's logprobs); streamed, that goes in the
choice's first chunk.
"""

from __future__ import annotations

from typing import Any

from pd.logprobs import Logprobs
from pd.server.generation import Delta, Generation, Sequence
from pd.server.logprobs import CompletionLogprobs, chat_logprobs


class Shape:
    """How completions spell an answer (OpenAI's text_completion objects)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    opens_with_role = False

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any,
                     first: bool) -> dict[str, Any]:
        return self.choice(index, text, finish_reason, logprobs)

    def logprobs(self, answer: Answer, index: int, rows: Logprobs | None, unscored: list[int]) -> Any:
        return answer.completion_logprobs(index).build(rows, unscored)


class ChatShape(Shape):
    """How chat spells an answer (OpenAI's chat.completion objects)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    opens_with_role = True

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any,
                     first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

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
        self._echoed: set[int] = set()  # choices whose first chunk went out

    def completion_logprobs(self, index: int) -> CompletionLogprobs:
        return self._logprobs.setdefault(index, CompletionLogprobs(self.token_strings))

    def choices(self) -> list[dict[str, Any]]:
        """Every choice, whole (after the generation finished)."""
        sequences = self.generation.sequences
        if len(sequences) > self.prepared.n:  # best_of: the most likely n
            sequences = sorted(sequences, key=lambda s: -s.cumulative_logprob)[:self.prepared.n]
        return [self._choice(i, sequence) for i, sequence in enumerate(sequences)]

    def _choice(self, index: int, sequence: Sequence) -> dict[str, Any]:
        return self._shaped(index, Delta(sequence.text, sequence.token_ids, sequence.finish_reason, index,
                                         sequence.logprobs), first=True, whole=True)

    def chunk_choice(self, delta: Delta) -> dict[str, Any]:
        """The choice of one streamed delta; the first of each choice carries the echo."""
        first = delta.index not in self._echoed
        self._echoed.add(delta.index)
        return self._shaped(delta.index, delta, first, whole=False)

    def _shaped(self, index: int, delta: Delta, first: bool, whole: bool) -> dict[str, Any]:
        text, token_ids, rows = delta.text, delta.token_ids, delta.logprobs
        if self.prepared.drop_output:
            text, token_ids, rows = "", [], None
        echo = self.prepared.echo if first else None
        unscored: list[int] = []
        if echo is not None:
            text = echo.text + text
            prompt_rows = self.generation.prompt_logprobs
            if self.prepared.logprobs is not None and prompt_rows is not None:
                unscored = echo.token_ids[:1]
                rows = _joined(prompt_rows, rows)
        logprobs = None
        if self.prepared.logprobs is not None:
            logprobs = self.shape.logprobs(self, index, rows, unscored)
        choice = (self.shape.choice(index, text, delta.finish_reason, logprobs) if whole else
                  self.shape.chunk_choice(index, text, delta.finish_reason, logprobs, first=False))
        if self.prepared.return_token_ids:
            choice["token_ids"] = token_ids
            if whole:
                choice["prompt_token_ids"] = list(self.prepared.engine_request.prompt_token_ids)
        return choice

    def role_chunk_choices(self) -> list[dict[str, Any]]:
        """Chat streams open with each choice's role."""
        token_ids = {"token_ids": []} if self.prepared.return_token_ids else {}
        return [self.shape.chunk_choice(i, "", None, None, first=True) | token_ids for i in range(self.prepared.n)]


def _joined(first: Logprobs, then: Logprobs | None) -> Logprobs:
    rows = first.rows(0)
    if then is not None:
        rows.append(then)
    return rows
