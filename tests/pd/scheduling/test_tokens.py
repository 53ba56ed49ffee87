"""A request's tokens in a step: Mamba-aligned chunks, and what ends a request."""

from __future__ import annotations

from pd.contracts.request import Request, RequestStatus
from pd.contracts.sampling_params import SamplingParams
from pd.scheduling.tokens import chunk_tokens, samples, stop_status

EOS = 7


def test_a_partial_chunk_ends_on_a_mamba_block_boundary_when_one_fits() -> None:
    request = Request("r", list(range(100)), SamplingParams(max_tokens=4))
    assert chunk_tokens(request, 0, 40, None) == 40
    assert chunk_tokens(request, 0, 40, 16) == 32  # two blocks, not 40 tokens
    assert chunk_tokens(request, 10, 40, 16) == 38  # to 48, a boundary
    assert chunk_tokens(request, 0, 10, 16) == 10  # no boundary fits: the budget
    assert chunk_tokens(request, 90, 40, 16) == 10  # the rest: not partial
    assert samples(request, 100) and not samples(request, 99)


def test_a_token_stops_the_request_by_eos_stop_ids_grammar_or_length() -> None:
    def status(token: int, *, ignore_eos: bool = False, grammar_stopped: bool = False, outputs: int = 1,
               max_model_len: int = 100) -> RequestStatus | None:
        request = Request("r", [1, 2], SamplingParams(max_tokens=3, ignore_eos=ignore_eos, stop_token_ids=[9]))
        for _ in range(outputs):
            request.append_output_token_ids(token)
        return stop_status(request, token, frozenset({EOS}), max_model_len, grammar_stopped)

    assert status(5) is None
    assert status(EOS) is RequestStatus.FINISHED_STOPPED
    assert status(EOS, ignore_eos=True) is None
    assert status(9, ignore_eos=True) is RequestStatus.FINISHED_STOPPED
    assert status(5, grammar_stopped=True) is RequestStatus.FINISHED_STOPPED
    assert status(5, outputs=3) is RequestStatus.FINISHED_LENGTH_CAPPED
    assert status(5, max_model_len=3) is RequestStatus.FINISHED_LENGTH_CAPPED
