"""Incremental detokenization with stop strings, for streaming.

Text is released only when it is final: a token that ends inside a multi-byte UTF-8
character decodes to a trailing U+FFFD, so it waits for the tokens completing it; and
with stop strings, the last `len(longest stop) - 1` characters wait in case they begin
a stop string. The released pieces concatenate to `tokenizer.decode(all ids)`, cut
before the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids with `add`, take releasable text back; `finish` releases the rest.

    Decoding uses a window `ids[prefix_offset:]`: `prefix_offset..read_offset` are
    tokens already turned into text, kept as left context so that decoders that depend
    on the preceding token (leading spaces, byte fallback) give the same text as a
    whole-sequence decode.
    """

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens  # stop strings count only from this many tokens on
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string was found; the text ends before it
        self._text = ""  # decoded so far (cut at a stop string)
        self._released = 0  # characters of _text handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        """All text decoded so far, released or not."""
        return self._text

    @property
    def released(self) -> int:
        """Characters of `text` handed out."""
        return self._released

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; return the text that is now final (may be "")."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        self._append(self._decode_new(final=False))
        return self._release(final=self.stopped)

    def resume(self, token_ids: Sequence[int], released_chars: int) -> None:
        """Stand where a stream of `token_ids` stands after `released_chars` characters of
        its text were released (by another server: a resumed stream). The tokens are fed
        one at a time, as that server fed them. ValueError if they already end at a stop
        string, or make fewer characters than were released."""
        for token_id in token_ids:
            self.add([token_id])
        if self.stopped:
            raise ValueError("the resumed tokens already end at a stop string")
        if not 0 <= released_chars <= len(self._text):
            raise ValueError(f"{released_chars} characters released, but the resumed tokens make "
                             f"{len(self._text)} so far")
        self._released = released_chars

    def finish(self) -> str:
        """The request ended: release everything held, incomplete characters included."""
        if not self.stopped:
            self._append(self._decode_new(final=True))
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset:]
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(window)
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        # A stop string may straddle the old end: search from where it could begin.
        start = max(0, len(self._text) - self._hold)
        self._text += new_text
        if len(self.token_ids) < self.min_tokens:
            return
        hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self._text) if final else max(self._released, len(self._text) - self._hold)
        delta = self._text[self._released:end]
        self._released = end
        return delta
