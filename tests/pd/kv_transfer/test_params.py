"""The typed PD parameters: what parses, and that every malformed set is refused with
an error naming its field (the server turns it into a 400)."""

from __future__ import annotations

import math

import msgspec
import pytest

from pd.kv_transfer.params import RemoteDecodeParams, RemotePrefillParams, TransferParamsError, parse_transfer_params

GOOD = {"do_remote_prefill": True, "remote_engine_id": "pd-abc", "remote_host": "127.0.0.1", "remote_port": 5555,
        "remote_request_id": "cmpl-1-xyz", "remote_block_ids": [[1, 2, 3], [0, 0, 4]], "num_prompt_tokens": 40,
        "first_token_ids": [7], "block_size": 16, "tp_size": 1, "lease_expires_at": 1.8e9}


def test_a_remote_prefill_set_round_trips_through_json() -> None:
    params = parse_transfer_params(GOOD)
    assert isinstance(params, RemotePrefillParams)
    assert params.remote_block_ids == [[1, 2, 3], [0, 0, 4]] and params.first_token_ids == [7]
    assert params.to_json() == GOOD | {"lease_seconds": None, "prompt_digest": None, "signature": None,
                                      "first_logprobs": None, "prompt_logprobs": None, "lease_slot": None,
                                      "lease_token": None, "prompt_sources": None, "kv_digests": None}
    assert parse_transfer_params(params.to_json()) == params


@pytest.mark.parametrize("raw", [None, {}, {"do_remote_decode": False}, {"do_remote_prefill": False}])
def test_no_pd(raw) -> None:
    assert parse_transfer_params(raw) is None


def test_remote_decode() -> None:
    assert parse_transfer_params({"do_remote_decode": True}) == RemoteDecodeParams(True)


def without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


BAD = {
    "first_token_ids missing": (without("first_token_ids"), "first_token_ids"),
    "first_token_ids a number": (GOOD | {"first_token_ids": 7}, "first_token_ids"),
    "first_token_ids empty": (GOOD | {"first_token_ids": []}, "first_token_ids"),
    "first_token_ids string": (GOOD | {"first_token_ids": ["7"]}, "first_token_ids"),
    "first_token_ids negative": (GOOD | {"first_token_ids": [-7]}, "first_token_ids"),
    "first_token_ids float": (GOOD | {"first_token_ids": [7.0]}, "first_token_ids"),
    "first_token_ids huge": (GOOD | {"first_token_ids": [2**70]}, "first_token_ids"),
    "first_token_ids too many": (GOOD | {"first_token_ids": [7] * 1025}, "first_token_ids"),
    "first_logprobs a positive logprob": (GOOD | {"first_logprobs": {"token_ids": [[7]], "logprobs": [[0.5]],
                                                                     "ranks": [1]}}, "first_logprobs.logprobs"),
    "first_logprobs far below the floor": (GOOD | {"first_logprobs": {"token_ids": [[7]], "logprobs": [[-1e300]],
                                                                         "ranks": [1]}}, "first_logprobs.logprobs"),
    "first_logprobs rows of unequal length": (GOOD | {"first_logprobs": {"token_ids": [[7, 8]], "logprobs": [[-1.0]],
                                                                          "ranks": [1]}}, "first_logprobs"),
    "first_logprobs a row of 22 tokens": (GOOD | {"first_logprobs": {"token_ids": [[7] * 22], "logprobs": [[-1.0] * 22],
                                                                      "ranks": [1]}}, "first_logprobs.token_ids"),
    "prompt_logprobs starting at 0": (GOOD | {"prompt_logprobs": {"token_ids": [], "logprobs": [], "ranks": [],
                                                                   "start": 0}}, "prompt_logprobs.start"),
    "prompt_sources of an unknown source": (GOOD | {"prompt_sources": {"elsewhere": 3}}, "prompt_sources"),
    "prompt_sources negative": (GOOD | {"prompt_sources": {"computed": -1}}, "prompt_sources.computed"),
    "prompt_sources not a map": (GOOD | {"prompt_sources": [["computed", 1]]}, "prompt_sources"),
    "remote_port string": (GOOD | {"remote_port": "abc"}, "remote_port"),
    "remote_port null": (GOOD | {"remote_port": None}, "remote_port"),
    "remote_port zero": (GOOD | {"remote_port": 0}, "remote_port"),
    "remote_port too big": (GOOD | {"remote_port": 70000}, "remote_port"),
    "remote_port bool": (GOOD | {"remote_port": True}, "remote_port"),
    "num_prompt_tokens past int64": (GOOD | {"num_prompt_tokens": 2**65}, "num_prompt_tokens"),
    "block id negative": (GOOD | {"remote_block_ids": [[1, -1, 3], [0, 0, 4]]}, "remote_block_ids"),
    "block id past int64": (GOOD | {"remote_block_ids": [[1, 2**64, 3], [0, 0, 4]]}, "remote_block_ids"),
    "block ids flat": (GOOD | {"remote_block_ids": [1, 2, 3]}, "remote_block_ids"),
    "block ids empty": (GOOD | {"remote_block_ids": []}, "remote_block_ids"),
    "block ids not a list": (GOOD | {"remote_block_ids": "1,2"}, "remote_block_ids"),
    "block_size zero": (GOOD | {"block_size": 0}, "block_size"),
    "tp_size 0": (GOOD | {"tp_size": 0}, "tp_size"),
    "tp_size 257": (GOOD | {"tp_size": 257}, "tp_size"),
    "engine id empty": (GOOD | {"remote_engine_id": ""}, "remote_engine_id"),
    "host too long": (GOOD | {"remote_host": "h" * 300}, "remote_host"),
    "lease NaN": (GOOD | {"lease_expires_at": math.nan}, "lease_expires_at"),
    "lease infinite": (GOOD | {"lease_expires_at": math.inf}, "lease_expires_at"),
    "unknown field": (GOOD | {"evil": 1}, "evil"),
    "both flags": (GOOD | {"do_remote_decode": True}, "do_remote_decode"),
    "decode with extras": ({"do_remote_decode": True, "remote_port": 1}, "remote_port"),
    "flags not booleans": ({"do_remote_decode": "yes"}, "do_remote_decode"),
    "no flag but fields": ({"remote_port": 1}, "remote_port"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_malformed_set_is_refused_naming_the_field(name: str) -> None:
    raw, field = BAD[name]
    with pytest.raises(TransferParamsError) as info:
        parse_transfer_params(raw)
    assert info.value.field == f"kv_transfer_params.{field}", str(info.value)
    assert field in str(info.value)


@pytest.mark.parametrize("raw", [[1], "x", 5, True])
def test_params_that_are_not_an_object_are_refused(raw) -> None:
    with pytest.raises(TransferParamsError, match="must be an object"):
        parse_transfer_params(raw)


def test_one_tagged_union_from_the_server_to_the_engine() -> None:
    """EngineRequest carries either kind in one field; the tag stays out of the JSON."""
    from pd.contracts.sampling_params import SamplingParams
    from pd.engine.ipc_messages import EngineRequest, input_decoder

    for params in (parse_transfer_params(GOOD), RemoteDecodeParams(True), None):
        request = EngineRequest.create("r", [1, 2], SamplingParams(), params)
        assert input_decoder().decode(msgspec.msgpack.encode(request)).kv_transfer_params == params
    assert "kind" not in parse_transfer_params(GOOD).to_json()


@pytest.mark.parametrize("field, changes", [
    ("first_token_ids", {"first_token_ids": [50]}),
    ("first_logprobs", {"first_logprobs": {"token_ids": [[7, 50]], "logprobs": [[-0.1, -2.0]], "ranks": [1]}}),
])
def test_token_ids_outside_the_vocabulary_are_named(field: str, changes: dict) -> None:
    params = parse_transfer_params(GOOD | changes)
    logprobs = 1 if "first_logprobs" in changes else None
    with pytest.raises(TransferParamsError, match="outside the vocabulary") as error:
        params.check_request(list(range(40)), 1, logprobs, None, vocab_size=50)
    assert error.value.field == f"kv_transfer_params.{field}"
    params.check_request(list(range(40)), 1, logprobs, None, vocab_size=51)  # 50 is in a vocabulary of 51
