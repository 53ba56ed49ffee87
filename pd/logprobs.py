"""Scored tokens, as the engine keeps them, the engine process sends them to the server
and a prefill server hands them to a decode server (torch-free; computed in
pd/worker/scoring.py).

A sampled token's logprob is taken from the logits it is chosen from: after its
structured-output mask, logit_bias, penalties and min_tokens hold-back, before
temperature, top-k, top-p and min-p (pd/worker/sampler.py); with `--logprobs-mode raw`,
from the model's logits after the mask only (vLLM's default). A token the request could
not pick has logprob -inf, reported as LOGPROB_FLOOR (-9999.0, as vLLM reports it), so
every value is a finite JSON number. The field bounds are checked where rows are decoded
from outside (IPC, kv_transfer_params); rows built here are not re-checked.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per position
LOGPROB_FLOOR = -9999.0  # what -inf is reported as
Logprob = Annotated[float, msgspec.Meta(ge=LOGPROB_FLOOR, le=0.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Row = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=1 + MAX_LOGPROBS)]
Values = Annotated[list[Logprob], msgspec.Meta(min_length=1, max_length=1 + MAX_LOGPROBS)]
Rank = Annotated[int, msgspec.Meta(ge=1, lt=2**31)]


class Logprobs(msgspec.Struct, forbid_unknown_fields=True):
    """Scored tokens, one row each: `token_ids[i][0]` is the scored token and
    `token_ids[i][1:]` the k most likely tokens at its position, most likely first;
    `logprobs[i]` their log-probabilities; `ranks[i]` the scored token's rank (1 = most
    likely; ties share the better rank)."""

    token_ids: list[Row] = []
    logprobs: list[Values] = []
    ranks: list[Rank] = []

    def __len__(self) -> int:
        return len(self.ranks)

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.ranks):
            raise ValueError("logprobs rows: token_ids, logprobs and ranks differ in length")
        if any(len(ids) != len(values) for ids, values in zip(self.token_ids, self.logprobs)):
            raise ValueError("logprobs rows: a row has more token ids than logprobs, or fewer")

    def append(self, rows: Logprobs) -> None:
        self.token_ids += rows.token_ids
        self.logprobs += rows.logprobs
        self.ranks += rows.ranks

    def rows(self, start: int, end: int | None = None) -> Logprobs:
        return Logprobs(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])

    @property
    def width(self) -> int | None:
        """Tokens per row (1 + k) when every row has the same number; None otherwise."""
        widths = {len(ids) for ids in self.token_ids}
        return widths.pop() if len(widths) == 1 else None


class PromptLogprobs(Logprobs):
    """Logprobs of the prompt tokens at indices `start` .. `end - 1` (token 0 has none:
    nothing precedes it). Row i scores token `start + i` given the tokens before it
    (k = the request's `prompt_logprobs`)."""

    start: Annotated[int, msgspec.Meta(ge=1, lt=2**31)] = 1

    @property
    def end(self) -> int:
        return self.start + len(self.ranks)

    def extend(self, chunk: PromptLogprobs) -> None:
        """Append the part of the next chunk not held yet (a request recomputed after a
        preemption scores its prompt again; those rows are dropped)."""
        skip = self.end - chunk.start
        if skip < 0:
            raise ValueError(f"prompt logprobs chunk starts at {chunk.start}, after the {self.end} held")
        self.append(chunk.rows(skip))
