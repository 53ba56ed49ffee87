"""SamplingParams: how a request picks tokens and when it stops, one msgspec struct from
where a request enters (the server's body, `pd.LLM`) to the sampler. It checks its
fields when built and when the engine process decodes it, and names the field that is
out of range (`SamplingParamsError.field`)."""

from __future__ import annotations

import msgspec

from pd.logprobs import MAX_LOGPROBS
from pd.structured.grammar import Grammar

MAX_LOGIT_BIAS = 100.0  # |bias| a request may add to a token's logit (OpenAI's range)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range); repetition_penalty in (0, 2]
MAX_N = 128  # the most sequences one request may ask for (OpenAI's bound on n)


class SamplingParamsError(ValueError):
    """A field out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    """How to pick tokens and when to stop. `temperature=0` is greedy; `top_k=None` and
    `top_p=1.0` filter nothing; `seed` makes a request's sampling reproducible whatever
    it is batched with. `prompt_logprobs=k` scores every prompt token (with the k most
    likely tokens at each position; 0 for the prompt token alone), which computes the
    whole prompt: its prefix-cache hits are not used. `logit_bias` adds (token id, bias)
    to those logits before anything else (greedy picks among the biased logits too);
    the penalties come next, as vLLM applies them: `repetition_penalty` divides the positive
    logits (multiplies the negative ones) of every token in the prompt or the output so
    far; `frequency_penalty` x (times the token was output) + `presence_penalty` (if it
    was) is subtracted. `min_p` then drops, after temperature, the tokens less likely than
    min_p times the most likely one. Until a request has `min_tokens` output tokens, EOS
    (unless ignored) and its stop tokens cannot be sampled, and stop strings do not stop it.

    `logprobs=k` (0-20) scores each sampled token, with the k most likely tokens at its
    position. `n` sequences share one prefill: at the first token the request forks into n
    (see `Request.index`), sequence j sampling with `seed + j` when seeded. With a
    `grammar`, only the tokens it allows are sampled (masked before anything else), and
    the request stops where the grammar ends.

    Treat it as immutable (`msgspec.structs.replace` makes a changed copy): requests and
    their sequences share it."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        """Check every field (SamplingParamsError naming the first out of range); lists
        become tuples."""
        for name, ok, rule in self._rules():
            if not ok:
                raise SamplingParamsError(name, f"{name} must be {rule}, got {getattr(self, name)}")
        bias = tuple((int(token), float(value)) for token, value in self.logit_bias)
        if any(not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS for _, value in bias):  # NaN fails too
            raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                                    f"{MAX_LOGIT_BIAS:g}]")
        if len({token for token, _ in bias}) != len(bias):
            raise SamplingParamsError("logit_bias", "logit_bias names a token twice")
        self.logit_bias = bias
        self.stop_token_ids = tuple(self.stop_token_ids)

    def _rules(self) -> list[tuple[str, bool, str]]:
        """(field, whether it holds, the rule in words), in the order they are checked."""
        k_ok = [k is None or 0 <= k <= MAX_LOGPROBS for k in (self.prompt_logprobs, self.logprobs)]
        return [
            ("max_tokens", self.max_tokens > 0, "positive"),
            ("temperature", self.temperature >= 0, "non-negative"),
            ("top_k", self.top_k is None or self.top_k > 0, "positive (or None for no limit)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("prompt_logprobs", k_ok[0], f"in [0, {MAX_LOGPROBS}]"),
            ("logprobs", k_ok[1], f"in [0, {MAX_LOGPROBS}]"),
            ("n", 1 <= self.n <= MAX_N, f"in [1, {MAX_N}]"),
            ("presence_penalty", -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
             f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            ("frequency_penalty", -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
             f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= MAX_PENALTY, f"in (0, {MAX_PENALTY:g}]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"in [0, max_tokens={self.max_tokens}]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sequence(self, index: int) -> SamplingParams:
        """The params of sequence `index` (> 0) of an n > 1 request: one sequence, seeded
        with `seed + index` when the request is seeded."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
