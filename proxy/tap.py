"""What a decode server's answer says of each choice as it passes to the client: its token
ids (D is asked for them, `return_token_ids`), the characters of its text sent, its
finish reason. The canary compares the first choice's token ids (canary.py); a stream
that breaks is resumed from them elsewhere (migration.py). The token ids are taken out
of what the client gets unless the client asked for them too.

With `hold_errors` (the stream may be resumed) an error event D sends midway is kept
from the client (`error`), with everything after it: the proxy resumes the stream, or
ends it with an error of its own. Once resumed, every chunk carries the first server's
`id` and `created`, so that the client sees one answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]"


@dataclass
class Choice:
    """One choice as the client has it so far."""

    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0  # of its text (completions) or content (chat), as sent
    finish_reason: str | None = None


@dataclass
class Tap:
    keep: bool  # the client asked for token ids itself
    hold_errors: bool = False
    choices: dict[int, Choice] = field(default_factory=dict)  # by index
    broken: str | None = None  # why the answer could not be read (no canary then)
    error: dict[str, Any] | None = None  # an error event held back (hold_errors)
    events: int = 0  # events passed to the client
    envelope: dict[str, Any] | None = None  # the first chunk's id and created
    _pending: bytes = b""

    @property
    def token_ids(self) -> list[int]:
        """The first choice's."""
        return self.choice(0).token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choice(0).finish_reason

    def choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice())

    def body(self, content: bytes) -> bytes:
        """An unstreamed answer: its token ids read, and taken out if the client did not ask."""
        try:
            answer = json.loads(content)
            choice = answer["choices"][0]
            self.choices[0] = Choice(list(choice["token_ids"]), finish_reason=choice.get("finish_reason"))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self.broken = f"an answer without token ids ({type(exc).__name__})"
            return content
        if self.keep:
            return content
        for choice in answer["choices"]:
            _strip(choice)
        return json.dumps(answer).encode()

    def chunk(self, data: bytes) -> bytes:
        """Part of a stream: what of it goes to the client now (every event it completes,
        read, and rewritten where it must be); the rest is kept until its end comes."""
        self._pending += data
        head, sep, rest = self._pending.rpartition(b"\n\n")
        if not sep:
            return b""
        self._pending = rest
        out = b""
        for event in (head + sep).split(b"\n\n")[:-1]:
            event = self._event(event)
            if event is not None:
                out += event + b"\n\n"
                self.events += 1
        return out

    def switched(self) -> None:
        """Another server's stream follows: what is left of this one's is dropped."""
        self._pending, self.error = b"", None

    def flush(self) -> bytes:
        """What is left of a stream that ended without a last blank line."""
        rest, self._pending = self._pending, b""
        return b"" if self.error is not None else rest

    def _event(self, event: bytes) -> bytes | None:
        if self.error is not None:
            return None  # after an error held back, nothing goes out (the [DONE] included)
        if not event.startswith(b"data: {"):
            return event
        try:
            chunk = json.loads(event[len(b"data: "):])
            if self.hold_errors and isinstance(chunk.get("error"), dict):
                self.error = chunk["error"]
                return None
            rewritten = self._envelope(chunk)
            for choice in chunk.get("choices") or []:
                self._read(choice)
                if not self.keep:
                    rewritten = _strip(choice) or rewritten
        except (ValueError, AttributeError, TypeError) as exc:
            self.broken = f"a stream event that is not a chunk ({type(exc).__name__})"
            return event
        if not rewritten:
            return event
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()

    def _read(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        held = self.choice(index if isinstance(index, int) else 0)
        held.token_ids += choice.get("token_ids") or []
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else delta.get("content")
        held.text_chars += len(text) if isinstance(text, str) else 0
        held.finish_reason = choice.get("finish_reason") or held.finish_reason

    def _envelope(self, chunk: dict[str, Any]) -> bool:
        """The first chunk's id and created, kept; a later server's chunk given them
        (whether it was)."""
        if "id" not in chunk:
            return False
        envelope = {"id": chunk["id"], "created": chunk.get("created")}
        if self.envelope is None:
            self.envelope = envelope
        if envelope == self.envelope:
            return False
        chunk.update(self.envelope)
        return True


def _strip(choice: dict[str, Any]) -> bool:
    """Take the token ids out of a choice; whether it had any."""
    had = "token_ids" in choice or "top_token_ids" in choice
    for key in ("token_ids", "top_token_ids"):
        choice.pop(key, None)
    return had
