"""`pd serve --quantization int8` as P, D and colocated: prefill on one int8 server and
decode on another gives the tokens one int8 server gives alone (the KV cache format does not
change with the weights' quantization), and both servers end holding no KV."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.pd_client import complete, p_then_d

pytestmark = pytest.mark.slow


def test_int8_prefill_then_decode_gives_the_colocated_int8_tokens(start) -> None:
    p, d = start.all(("p", "--quantization", "int8", "--kv-connector", "nixl"),
                     ("d", "--quantization", "int8", "--kv-connector", "nixl"))
    assert "quantization int8" in p.log_tail() and "quantization int8" in d.log_tail()
    rng = random.Random("int8")
    for n in (5, 40, 300):
        body = {"prompt": [rng.randrange(300, 3800) for _ in range(n)], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        expected = complete(p, body)
        for streamed in (False, True):
            got = p_then_d(p, d, body, streamed)
            assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "length"), n
    for server in (p, d):
        assert server.metrics().get("pd_kv_transfer_failures_total", 0.0) == 0
        assert server.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_the_api_process_loads_no_torch(start) -> None:
    """The flag's names live in pd.config, which the API process imports: importing the
    quantization module there would load torch and its threads beside the engine's."""
    server = start("api", "--quantization", "int8")
    engine_pid = server.health().json()["engine_pid"]
    assert engine_pid != server.process.pid
    assert "libtorch" not in Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{engine_pid}/maps").read_text()
