"""The phases a server's span shows from the engine's `RequestTimes`: what P, D (its KV
read from P) and a colocated server each did, never a span that ends before it starts."""

from __future__ import annotations

import msgspec

from pd.contracts.request import RequestTimes
from pd.server.spans import phases


def named(times: RequestTimes, output_tokens: int) -> list[tuple[str, float, float]]:
    return [(name, start, end) for name, start, end, _ in phases(times, output_tokens)]


def test_a_colocated_request_queues_prefills_and_decodes() -> None:
    times = RequestTimes(1.0, scheduled=2.0, first_token=3.0, finished=5.0)
    assert named(times, 4) == [("pd.queue", 1.0, 2.0), ("pd.prefill", 2.0, 3.0), ("pd.decode", 3.0, 5.0)]


def test_p_prefills_its_one_token_and_decodes_nothing() -> None:
    times = RequestTimes(1.0, scheduled=1.5, first_token=3.0, finished=3.0)
    assert named(times, 1) == [("pd.queue", 1.0, 1.5), ("pd.prefill", 1.5, 3.0)]


def test_d_waits_for_the_kv_read_then_decodes_from_p_s_first_token() -> None:
    times = RequestTimes(1.0, kv_wait=1.25, kv_landed=2.0, kv_tokens=48, kv_bytes=4096, kv_descriptors=3,
                         first_token=2.0, scheduled=2.5, finished=4.0)
    out = phases(times, 6)
    assert [(n, s, e) for n, s, e, _ in out] == [("pd.queue", 1.0, 1.25), ("pd.kv_read", 1.25, 2.0),
                                                  ("pd.decode", 2.5, 4.0)]
    assert out[1][3] == {"pd.kv_tokens": 48, "pd.kv_bytes": 4096, "pd.kv_descriptors": 3}
    failed = phases(msgspec.structs.replace(times, kv_error="the read failed in transfer"), 6)
    assert failed[1][3]["pd.kv_error"] == "the read failed in transfer"  # why the KV it waited for did not come


def test_a_request_that_never_ran_only_queued() -> None:
    assert named(RequestTimes(1.0, finished=1.5), 0) == [("pd.queue", 1.0, 1.5)]
