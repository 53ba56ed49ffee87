"""How many prompt tokens a step may compute beside its decodes (`--max-step-ms`).

A step that carries a prefill chunk delays the next token of every stream running in it
by the chunk's time: one 1024-token chunk of the real Gemma on two cores is a ~250 ms
gap in eight streams. The budget bounds that gap. From the steps already taken it learns
what a step costs,

    seconds = base + per_decode * decodes + per_prompt_token * prompt tokens

(least squares over the last `WINDOW` steps, refitted every `REFIT_EVERY`), and gives a
step that carries decodes only as many prompt tokens as keep its predicted time within
the limit. The limit is `--max-step-ms`, or by default `AUTO_FACTOR` times the step
the decodes alone would take: a prefill at most doubles a stream's inter-token gap, and
still goes at half the machine while streams run.

A step with no decode has no stream to delay and takes the whole
`--max-num-batched-tokens`; so does a step in which at least as many requests wait to
compute their prompts as are decoding: the streams it delays are then the fewer, and the
prompts it starts together decode together after, in a full batch (let in a few tokens at
a time beside the streams, they would keep the batch short and staggered, every later
arrival again stalling the many); and so does every step until the cost of a prompt token
is known (two different prompt-token counts seen). At least `MIN_CHUNK` prompt tokens go in
every step, so that prefills go on even when the decodes alone reach the limit.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

WINDOW = 256  # steps the cost is fitted over
REFIT_EVERY = 16  # steps between fits
MIN_CHUNK = 32  # prompt tokens a step may always take
AUTO_FACTOR = 2.0  # the default limit: this many times the decodes' own step


class StepBudget:
    def __init__(self, max_tokens: int, max_step_ms: float | str) -> None:
        """`max_step_ms`: milliseconds, "auto" (`AUTO_FACTOR`) or "off" (every step may
        take `max_tokens`)."""
        self.max_tokens = max_tokens
        self.auto = max_step_ms == "auto"
        self.max_step_seconds = None if isinstance(max_step_ms, str) else max_step_ms / 1000
        self._steps = np.zeros((WINDOW, 3))  # per step: decodes, prompt tokens, seconds
        self._num_steps = 0
        self._planned: tuple[int, int] = (0, 0)
        self.cost: tuple[float, float, float] | None = None  # base, per decode, per prompt token (seconds)

    @property
    def limited(self) -> bool:
        return self.auto or self.max_step_seconds is not None

    def for_step(self, to_compute: Iterable[int], num_waiting: int, max_num_seqs: int) -> int:
        """`prompt_tokens` for a step whose running requests have `to_compute` tokens each to
        compute (1: a decode) while `num_waiting` wait to start, as many of them as the
        batch (`max_num_seqs`) has room for counted among the prompts."""
        counts = list(to_compute)
        decodes = counts.count(1)
        room = max(max_num_seqs - len(counts), 0)
        return self.prompt_tokens(decodes, sum(1 for n in counts if n > 1) + min(num_waiting, room))

    def prompt_tokens(self, num_decodes: int, num_prompts: int = 0) -> int:
        """The most prompt tokens a step may compute beside `num_decodes` decodes while
        `num_prompts` requests that could go in it have prompt tokens to compute."""
        room = max(self.max_tokens - num_decodes, 0)
        if not self.limited or num_decodes == 0 or num_prompts >= num_decodes or self.cost is None:
            return room
        base, per_decode, per_token = self.cost
        decodes_alone = base + per_decode * num_decodes
        if not decodes_alone > 0:  # a fit this far from the steps says nothing yet
            return room
        limit = AUTO_FACTOR * decodes_alone if self.max_step_seconds is None else self.max_step_seconds
        fits = int((limit - decodes_alone) / per_token)
        return min(room, max(fits, MIN_CHUNK))

    def planned(self, num_scheduled_tokens: Iterable[int]) -> None:
        """The step about to run, its tokens per request: a request with one token is a
        decode (the last token of a prompt costs as much), more are prompt tokens. Nothing
        is kept unlimited."""
        if not self.limited:
            return
        counts = list(num_scheduled_tokens)
        self._planned = (counts.count(1), sum(n for n in counts if n > 1))

    def took(self, seconds: float) -> None:
        """The wall time of the step last planned (one with nothing to compute is not kept)."""
        decodes, prompt_tokens = self._planned
        self._planned = (0, 0)
        if decodes + prompt_tokens == 0:
            return
        self._steps[self._num_steps % WINDOW] = (decodes, prompt_tokens, seconds)
        self._num_steps += 1
        if self._num_steps % REFIT_EVERY == 0:
            self.cost = fitted_cost(self._steps[:min(self._num_steps, WINDOW)]) or self.cost


def fitted_cost(steps: np.ndarray) -> tuple[float, float, float] | None:
    """(base, per decode, per prompt token) fitted to rows of (decodes, prompt tokens,
    seconds); None while a prompt token's cost cannot be told apart (fewer than two
    different prompt-token counts) or does not come out positive."""
    if len(np.unique(steps[:, 1])) < 2:
        return None
    inputs = np.column_stack([np.ones(len(steps)), steps[:, 0], steps[:, 1]])
    (base, per_decode, per_token), *_ = np.linalg.lstsq(inputs, steps[:, 2], rcond=None)
    if not per_token > 0:
        return None
    return float(base), float(per_decode), float(per_token)
