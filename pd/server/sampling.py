"""The sampling fields of an OpenAI body, validated against the model and the server's
limits, as the engine's SamplingParams; and what one request may cost."""

from __future__ import annotations

from dataclasses import dataclass

from pd.contracts.sampling_params import MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError
from pd.server.limits import RequestLimits
from pd.server.protocol import ChatCompletionRequest, RequestError, SamplingFields
from pd.structured.grammar import Grammar
from wire.codes import REQUEST_TOO_LARGE

MAX_SEED = 2**63
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def check_vocab(vocab_size: int, token_ids: list[int], param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                           param=param)


@dataclass(frozen=True)
class SamplingChecker:
    """A body's sampling fields against one model (its context and vocabulary) and the
    server's limits."""

    limits: RequestLimits
    max_model_len: int
    vocab_size: int

    def check_cost(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """RequestError unless the request's sequences times (prompt + max_tokens) are
        within `limits.max_request_tokens`."""
        cost = params.n * (num_prompt_tokens + params.max_tokens)
        if cost > self.limits.max_request_tokens:
            raise RequestError(f"the request asks for {params.n} sequences of up to {num_prompt_tokens} + "
                               f"{params.max_tokens} tokens ({cost}), more than this server's limit of "
                               f"{self.limits.max_request_tokens} a request (--max-request-tokens): ask for fewer "
                               "sequences or a lower max_tokens", param="max_tokens", code=REQUEST_TOO_LARGE)

    def _logit_bias(self, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} as (id, bias) pairs: ids in the vocabulary, biases
        in [-100, 100]."""
        if len(bias) > self.vocab_size:
            raise RequestError("logit_bias names more tokens than the vocabulary has", param="logit_bias")
        pairs = []
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit() or len(key) > 12:
                raise RequestError(f"logit_bias keys must be token ids, got {key[:32]!r}", param="logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                   f"got {value} for token {key}", param="logit_bias")
            pairs.append((int(key), float(value)))
        check_vocab(self.vocab_size, [token for token, _ in pairs], "logit_bias")
        return tuple(pairs)

    def _logprobs_and_choices(self, body: SamplingFields) -> tuple[int | None, int | None, int]:
        """(logprobs, prompt_logprobs, n) of the engine request: the logprobs a client
        asked for (best_of ranks sequences by theirs, so it asks for the sampled token's),
        the prompt's when echoing them, and the sequences to sample (best_of of them)."""
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        shown, limits = body.logprobs_shown, self.limits
        if shown is not None and not 0 <= shown <= limits.max_logprobs:
            param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise RequestError(f"{param} must be in [0, {limits.max_logprobs}], got {shown}", param=param)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= limits.max_sequences:
            raise RequestError(f"n must be in [1, {limits.max_sequences}], got {n}", param="n")
        best_of = n if body.best_of is None else body.best_of
        if not n <= best_of <= limits.max_sequences:
            raise RequestError(f"best_of must be in [n={n}, {limits.max_sequences}], got {best_of}", param="best_of")
        logprobs = 0 if best_of > n and shown is None else shown
        prompt_logprobs = shown if getattr(body, "echo", False) else None
        return logprobs, prompt_logprobs, best_of

    def sampling_params(self, body: SamplingFields, num_prompt_tokens: int, grammar: Grammar | None) -> SamplingParams:
        """The request's SamplingParams; RequestError naming the first field out of range."""
        room = self.max_model_len - num_prompt_tokens
        max_tokens = body.output_limit if body.output_limit is not None else room
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        if max_tokens == 0 and getattr(body, "echo", False):
            max_tokens = 1  # the prompt is scored by computing it; the token sampled is not answered
        if max_tokens <= 0:
            raise RequestError(f"{param} must be positive (or 0 with echo), got {max_tokens}", param=param)
        if max_tokens > room:
            raise RequestError(f"{param}={max_tokens} with a prompt of {num_prompt_tokens} tokens exceeds "
                               f"the context of {self.max_model_len} tokens", param=param,
                               code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0.0 <= temperature <= 2.0:
            raise RequestError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if body.top_k is not None and body.top_k < -1:
            raise RequestError(f"top_k must be positive, or 0 or -1 for no limit; got {body.top_k}", param="top_k")
        if body.seed is not None and not -MAX_SEED <= body.seed < MAX_SEED:
            raise RequestError("seed must fit in a signed 64-bit integer", param="seed")
        stop_token_ids = body.stop_token_ids or []
        check_vocab(self.vocab_size, stop_token_ids, "stop_token_ids")
        min_p = 0.0 if body.min_p is None else body.min_p
        logit_bias = self._logit_bias(body.logit_bias or {})
        min_tokens = body.min_tokens or 0
        if not 0 <= min_tokens <= max_tokens:
            raise RequestError(f"min_tokens must be in [0, {param}={max_tokens}], got {min_tokens}", param="min_tokens")
        penalties = {name: getattr(body, name) for name in PENALTIES if getattr(body, name) is not None}
        logprobs, prompt_logprobs, n = self._logprobs_and_choices(body)
        try:
            return SamplingParams(logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=n, grammar=grammar,
                                  max_tokens=max_tokens, temperature=temperature,
                                  top_k=body.top_k if body.top_k and 0 < body.top_k < self.vocab_size else None,
                                  top_p=top_p,
                                  seed=body.seed, stop_token_ids=tuple(stop_token_ids), ignore_eos=body.ignore_eos,
                                  logit_bias=logit_bias, min_p=min_p, min_tokens=min_tokens, **penalties)
        except SamplingParamsError as e:  # the ranges SamplingParams holds every request to
            raise RequestError(str(e), param=e.field) from None
