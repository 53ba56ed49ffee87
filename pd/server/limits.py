"""The limits group of a server's settings: what one request may cost, refused past it
(`pd serve --max-*`, each flag defaulting to its field's default). The engine has no
limits of its own beyond the scheduler's batch bounds (pd/config/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pd.contracts.sampling_params import MAX_N
from pd.logprobs import MAX_LOGPROBS
from wire.body import DEFAULT_LIMIT


@dataclass(frozen=True)
class RequestLimits:
    """`max_sequences` (n and best_of) and `max_logprobs` (alternatives per position) are
    refused past them with a 400 naming the field; so is `max_request_tokens`, a request's
    sequences times (prompt + max_tokens): the KV and the decode steps it can claim (the
    scheduler shares the batch fairly however big a request is, pd/scheduling/fair_share.py;
    these bound what one request may ask at all). A body past `max_request_bytes` is
    refused with 413 before it is read whole."""

    max_sequences: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_request_tokens: int = 1 << 20
    max_request_bytes: int = DEFAULT_LIMIT

    def __post_init__(self) -> None:
        if not 1 <= self.max_sequences <= MAX_N:
            raise ValueError(f"--max-sequences-per-request must be in [1, {MAX_N}], got {self.max_sequences}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if self.max_request_tokens < 1:
            raise ValueError(f"--max-request-tokens must be positive, got {self.max_request_tokens}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be positive, got {self.max_request_bytes}")


DEFAULT_LIMITS = RequestLimits()
