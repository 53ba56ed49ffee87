"""A request's tokens in one step, by the scheduler's rules: how many a chunk computes,
whether the step samples one, and whether a sampled token ends the request."""

from __future__ import annotations

from pd.contracts.request import Request, RequestStatus


def chunk_tokens(request: Request, computed: int, budget: int, mamba_block_size: int | None) -> int:
    """Tokens to compute this step past `computed`; with Mamba groups a partial chunk ends
    on a block boundary when at least one boundary fits in the budget (a request whose
    prompt KV comes from a remote prefill is exempt)."""
    remaining = request.num_tokens - computed
    num_new = min(remaining, budget)
    if mamba_block_size and num_new < remaining and not request.do_remote_prefill:
        aligned = (computed + num_new) // mamba_block_size * mamba_block_size - computed
        if aligned > 0:
            return aligned
    return num_new


def samples(request: Request, num_new: int) -> bool:
    """Whether the request samples a token after computing `num_new` more."""
    return request.num_computed_tokens + num_new >= request.num_tokens


def stop_status(request: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int,
                grammar_stopped: bool) -> RequestStatus | None:
    """How the request finishes with `token` appended (its last output token), if it does."""
    params = request.sampling_params
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids or grammar_stopped:
        return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def off_grammar(token: int) -> str:
    return f"token {token} does not follow the request's grammar"
