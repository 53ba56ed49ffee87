"""PD failure paths on real servers with real NIXL: P gone before D reads, a lease that
runs out, and a decode request D cannot serve from P's blocks (a reject).

A decode server, a prefill server and a prefill server with a 1 s lease are shared by
the tests that leave them as they found them (holding nothing; counters are compared
before and after); a test that stops a server or needs other flags starts its own."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from launch import http_client
from server_harness import Starter, stop_process

pytestmark = pytest.mark.slow
BODY = {"prompt": "An old lighthouse keeper kept a log of every ship that passed. " * 4,
        "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def complete(server, body: dict) -> dict:
    response = http_client().post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def prefill(p) -> dict:
    return complete(p, BODY | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]


@pytest.fixture(scope="module")
def shared(tiny_models, tmp_path_factory):
    """{"d": --role decode, "p": --role prefill, "p_short": --role prefill with a 1 s lease}."""
    logs = tmp_path_factory.mktemp("pd-failures")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        d, p, p_short = Starter(tiny_models["qwen3"], logs, stack).all(
            ("d", "--role", "decode"), ("p", "--role", "prefill"),
            ("p_short", "--role", "prefill", "--kv-lease-seconds", "1"))
        yield {"d": d, "p": p, "p_short": p_short}


def changes(server, before: dict[str, float]) -> dict[str, float]:
    """How much each counter of `server` moved since `before` (its metrics then)."""
    return {name: value - before.get(name, 0.0) for name, value in server.metrics().items()}


def test_p_gone_before_d_reads_d_recomputes_the_right_tokens(start, shared, colocated) -> None:
    p, d, c = start("p", "--kv-connector", "nixl"), shared["d"], colocated["qwen3"]
    params = prefill(p)
    stop_process(p.process)
    before = d.metrics()
    out = complete(d, BODY | {"kv_transfer_params": params})
    assert out["choices"][0]["text"] == complete(c, BODY)["choices"][0]["text"]
    moved = changes(d, before)
    assert moved["pd_kv_transfer_failures_total"] == 1 and moved["pd_kv_transfer_reads_total"] == 0
    assert moved['pd_kv_load_failures_total{policy="recompute"}'] == 1
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_p_gone_before_d_reads_with_the_fail_policy_d_answers_a_clear_error(start) -> None:
    """Roles without --kv-connector: prefill and decode servers take the NIXL connector."""
    p, d = start.all(("p", "--role", "prefill"), ("d", "--role", "decode", "--kv-load-failure-policy", "fail"))
    assert p.health().json()["role"] == "prefill" and d.health().json()["role"] == "decode"
    assert d.metrics()["pd_kv_transfer_reads_total"] == 0  # connector metrics exist from start-up
    params = [prefill(p), prefill(p)]
    stop_process(p.process)
    response = http_client().post(f"{d.url}/v1/completions", json=BODY | {"kv_transfer_params": params[0]}, timeout=60)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_load_failed" and "could not be loaded from the prefill server" in error["message"]
    with http_client().stream("POST", f"{d.url}/v1/completions", timeout=60,
                              json=BODY | {"kv_transfer_params": params[1], "stream": True}) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"code":502' in events[-2] and "could not be loaded" in events[-2]
    metrics = d.metrics()
    assert metrics['pd_kv_load_failures_total{policy="fail"}'] == 2
    assert metrics['pd_kv_load_failures_total{policy="recompute"}'] == 0
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    assert complete(d, BODY)["usage"]["completion_tokens"] == BODY["max_tokens"]  # still serving


def test_blocks_nobody_reads_are_freed_when_the_lease_ends(shared) -> None:
    p = shared["p_short"]
    before = p.metrics()
    prefill(p)
    assert p.metrics()["pd_kv_requests_held"] == 1 and p.metrics()["pd_kv_cache_usage"] > 0
    time.sleep(1.0)
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
    assert changes(p, before)["pd_kv_transfer_leases_expired_total"] == 1
    assert p.metrics()["pd_kv_cache_usage"] == 0


def test_a_request_d_cannot_load_is_computed_there_and_p_frees_at_once(shared, colocated) -> None:
    p, d, c = shared["p"], shared["d"], colocated["qwen3"]
    before = p.metrics()
    params = prefill(p)
    other = BODY | {"prompt": BODY["prompt"] + " And more."}  # not the prompt P prefilled
    out = complete(d, other | {"kv_transfer_params": params})
    assert out["choices"][0]["text"] == complete(c, other)["choices"][0]["text"]
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0  # before the 60 s lease
    assert changes(p, before)["pd_kv_transfer_rejects_total"] == 1


def test_a_request_waiting_in_d_s_queue_past_the_lease_still_reads_p_s_kv(start) -> None:
    """D keeps P's lease alive while the request waits (its one batch slot is taken), so
    the request is served with P's KV, not recomputed, however long the queue."""
    import threading

    p, d = start.all(("p", "--role", "prefill", "--kv-lease-seconds", "2"), ("d", "--role", "decode", "--max-num-seqs", "1"))
    params = prefill(p)
    result = {}
    sender = threading.Thread(target=lambda: result.update(
        response=http_client().post(f"{d.url}/v1/completions", json=BODY | {"kv_transfer_params": params},
                                    timeout=120)))
    hog = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with http_client().stream("POST", f"{d.url}/v1/completions", json=hog, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the slot is taken
        sender.start()
        queued_since = time.monotonic()
        while time.monotonic() - queued_since < 5.0:  # more than twice the lease
            next(lines)
    sender.join(120)  # the hog is aborted: the waiting request is admitted now
    assert result["response"].status_code == 200, result["response"].text
    assert p.metrics()["pd_kv_transfer_keep_alives_total"] >= 2
    assert p.metrics()["pd_kv_transfer_leases_expired_total"] == 0
    d_metrics = d.metrics()
    assert d_metrics["pd_kv_transfer_reads_total"] == 1 and d_metrics["pd_kv_transfer_failures_total"] == 0
    assert d_metrics['pd_kv_load_failures_total{policy="recompute"}'] == 0
    assert result["response"].json()["choices"][0]["text"] == complete(d, BODY)["choices"][0]["text"]
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0


def test_a_read_of_an_expired_lease_ends_as_a_failure_and_d_recomputes(shared) -> None:
    """P freed the blocks and went idle; it still progresses transfers for a while, so
    D's late read ends (as a failure: after the lease) instead of hanging the request."""
    p, d = shared["p_short"], shared["d"]
    expired = p.metrics()["pd_kv_transfer_leases_expired_total"]
    params = prefill(p)
    assert p.wait_for_metric("pd_kv_transfer_leases_expired_total", lambda v: v == expired + 1) == expired + 1
    before = d.metrics()
    out = complete(d, BODY | {"kv_transfer_params": params})
    assert out["choices"][0]["text"] == complete(d, BODY)["choices"][0]["text"]
    moved = changes(d, before)
    assert moved["pd_kv_transfer_failures_total"] == 1 and moved["pd_kv_transfer_reads_total"] == 0
    assert moved['pd_kv_load_failures_total{policy="recompute"}'] == 1
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
