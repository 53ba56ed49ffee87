"""The server's limits group: each `pd serve --max-*` flag defaults to its field's default,
and a bad value is refused by the group, naming the flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pd.server.limits import DEFAULT_LIMITS, RequestLimits
from pd.server.main import add_serve_flags

FLAGS = {"max_sequences": "max_sequences_per_request", "max_logprobs": "max_logprobs",
         "max_request_tokens": "max_request_tokens", "max_request_bytes": "max_request_bytes"}


def test_every_limit_is_a_flag_defaulting_to_its_field() -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--model", "m"])
    assert set(FLAGS) == {f.name for f in dataclasses.fields(RequestLimits)}
    assert {field: getattr(args, flag) for field, flag in FLAGS.items()} == dataclasses.asdict(DEFAULT_LIMITS)


@pytest.mark.parametrize("field, value, flag", [("max_sequences", 0, "--max-sequences-per-request"),
                                                ("max_logprobs", -1, "--max-logprobs"),
                                                ("max_request_tokens", 0, "--max-request-tokens"),
                                                ("max_request_bytes", 0, "--max-request-bytes")])
def test_a_bad_limit_is_refused_naming_its_flag(field: str, value: int, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RequestLimits(**{field: value})
