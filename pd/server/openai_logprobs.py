"""Logprobs as OpenAI's answers spell them: the completions `logprobs` object (tokens,
token_logprobs, top_logprobs, text_offset) and chat's `logprobs.content` list.

A token is shown as its own text (`Tokenizer.token_strings`). Completions' top_logprobs
map the scored token and the k most likely to their logprobs (so up to k + 1 entries, as
OpenAI's legacy API and vLLM answer; tokens with the same text share an entry); chat's
top_logprobs list the k most likely tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pd.logprobs import Logprobs

TokenStrings = Callable[[list[int]], list[str]]


class CompletionLogprobs:
    """One choice's logprobs object, built chunk by chunk: text offsets run on from one
    chunk to the next (they count the characters of the tokens shown before)."""

    def __init__(self, token_strings: TokenStrings) -> None:
        self.token_strings = token_strings
        self.text_offset = 0

    def build(self, rows: Logprobs | None, unscored: Sequence[int] = ()) -> dict[str, Any]:
        """The object for `unscored` tokens (shown with null logprobs: the prompt's first
        token, echoed) followed by the scored rows."""
        rows = rows or Logprobs()
        names = self.token_strings(list(unscored) + [t for ids in rows.token_ids for t in ids])
        tokens, token_logprobs, top, offsets = [], [], [], []
        for name in names[:len(unscored)]:
            tokens.append(name), token_logprobs.append(None), top.append(None), offsets.append(self._advance(name))
        position = len(unscored)
        for ids, values in zip(rows.token_ids, rows.logprobs):
            row_names = names[position:position + len(ids)]
            position += len(ids)
            tokens.append(row_names[0])
            token_logprobs.append(values[0])
            top.append(dict(zip(row_names, values)))
            offsets.append(self._advance(row_names[0]))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _advance(self, name: str) -> int:
        offset = self.text_offset
        self.text_offset += len(name)
        return offset


def chat_logprobs(token_strings: TokenStrings, rows: Logprobs | None) -> dict[str, Any]:
    """Chat's `logprobs`: each token with its logprob and bytes, and the k most likely."""
    rows = rows or Logprobs()
    names = token_strings([t for ids in rows.token_ids for t in ids])
    content, position = [], 0
    for ids, values in zip(rows.token_ids, rows.logprobs):
        row_names = names[position:position + len(ids)]
        position += len(ids)
        entries = [{"token": name, "logprob": value, "bytes": list(name.encode("utf-8"))}
                   for name, value in zip(row_names, values)]
        content.append(entries[0] | {"top_logprobs": entries[1:]})
    return {"content": content}
