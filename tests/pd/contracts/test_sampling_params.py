"""SamplingParams names the field that is out of range, when built and when the engine
process decodes it; lists become tuples."""

from __future__ import annotations

import msgspec
import pytest

from pd.contracts.sampling_params import SamplingParams, SamplingParamsError

OUT_OF_RANGE = {"max_tokens": 0, "temperature": -0.5, "top_k": 0, "top_p": 0.0, "prompt_logprobs": 21,
                "logprobs": -1, "n": 0, "presence_penalty": 2.5, "frequency_penalty": -3.0,
                "repetition_penalty": 0.0, "min_tokens": 17, "min_p": 1.5, "logit_bias": [(1, 101.0)]}


@pytest.mark.parametrize("field", list(OUT_OF_RANGE))
def test_a_field_out_of_range_is_named(field: str) -> None:
    with pytest.raises(SamplingParamsError, match=field) as error:
        SamplingParams(**{field: OUT_OF_RANGE[field]})
    assert error.value.field == field


@pytest.mark.parametrize("field", ["top_p", "min_tokens", "logit_bias"])
def test_decoding_checks_the_same_ranges(field: str) -> None:
    raw = msgspec.msgpack.encode({field: OUT_OF_RANGE[field]})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_lists_become_tuples_and_a_copy_round_trips() -> None:
    params = SamplingParams(stop_token_ids=[3, 4], logit_bias=[[5, 1]], seed=7, n=2)
    assert params.stop_token_ids == (3, 4) and params.logit_bias == ((5, 1.0),)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert params.for_sequence(1) == msgspec.structs.replace(params, n=1, seed=8)
    with pytest.raises(SamplingParamsError, match="twice"):
        SamplingParams(logit_bias=[(5, 1.0), (5, 2.0)])
