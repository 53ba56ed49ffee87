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
from tests.support.server_harness import Starter, stop_process

pytestmark = pytest.mark.slow
UNSIGNED = ("--kv-transfer-secret", "", "--allow-unsigned-kv-params")
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
    """{"d": --role decode, "p": --role prefill, "p_short": --role prefill with a 1 s lease},
    without a transfer secret: a test here presents parameters a signed deployment refuses
    at once (expired, or altered), to reach what D does with them."""
    logs = tmp_path_factory.mktemp("pd-failures")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        d, p, p_short = Starter(tiny_models["qwen3"], logs, stack).all(
            ("d", "--role", "decode", *UNSIGNED), ("p", "--role", "prefill", *UNSIGNED),
            ("p_short", "--role", "prefill", "--kv-lease-seconds", "1", *UNSIGNED))
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
    assert events[-1] == "data: [DONE]" and "could not be loaded" in events[-2]
    assert '"code":"kv_load_failed"' in events[-2]  # as the unstreamed answer's error says it
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
    misfit = params | {"remote_block_ids": [ids[:-1] for ids in params["remote_block_ids"]]}  # one block short
    out = complete(d, BODY | {"kv_transfer_params": misfit})
    assert out["choices"][0]["text"] == complete(c, BODY)["choices"][0]["text"]
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0  # before the 60 s lease
    assert changes(p, before)["pd_kv_transfer_rejects_total"] == 1


def test_a_request_waiting_in_d_s_queue_past_the_lease_still_reads_p_s_kv(start) -> None:
    """D keeps P's lease alive while the request waits (its one batch slot is taken), so
    the request is served with P's KV, not recomputed, however long the queue."""
    import threading

    p, d = start.all(("p", "--role", "prefill", "--kv-lease-seconds", "2"),
                     ("d", "--role", "decode", "--max-num-seqs", "1"))
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


def test_blocks_p_released_and_reused_before_d_read_them_are_never_answered_nor_cached(start) -> None:
    """Issue 31 row 3: P freed a request's blocks (a release) and reused them for other
    prompts; D then read them and answered 200 with wrong tokens, and kept the wrong KV
    in its prefix cache for later requests of that prompt. D now checks P's lease word
    after its read: the load fails (and is recomputed), nothing wrong is cached. (P holds
    another request meanwhile, so it polls NIXL: a READ carrying a notification to a P
    that does not poll never ended, and failed at the read timeout.)"""
    secret = ("--kv-transfer-secret", "row-3-secret")
    small = ("--kv-cache-memory", str(4 << 20), "--max-model-len", "512")  # 63 blocks of 16 tokens
    p, d, c = start.all(("p", "--role", "prefill", *secret, *small), ("d", "--role", "decode", *secret),
                        ("c", "--max-model-len", "512"))
    prompts = [list(range(100 * k + 1, 100 * k + 321)) for k in range(4)]  # 20 blocks each, nothing shared
    body = {"prompt": prompts[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    answer = lambda out: (out["choices"][0]["text"], out["choices"][0]["logprobs"]["token_logprobs"])  # noqa: E731
    reference = answer(complete(c, body))
    pd = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = complete(p, body | pd)["kv_transfer_params"]
    kept = complete(p, body | pd | {"prompt": [t + 2000 for t in prompts[0]]})["kv_transfer_params"]  # P polls
    release = {"remote_request_id": params["remote_request_id"], "signature": params["signature"]}
    released = http_client().post(f"{p.url}/v1/kv/release", json=release, timeout=10)
    if released.status_code == 400 and "signature" in released.text:  # a server from before the holder's proof
        released = http_client().post(f"{p.url}/v1/kv/release",
                                      json={"remote_request_id": release["remote_request_id"]})
    assert released.json() == {"released": True}
    for other in prompts[1:]:  # the third evicts and overwrites the released blocks
        complete(p, body | {"prompt": other})
    before = d.metrics()
    text, logprobs = answer(complete(d, body | {"kv_transfer_params": params}))
    assert text == reference[0] and logprobs == pytest.approx(reference[1], abs=1e-4)  # not another prompt's KV
    moved = changes(d, before)
    assert moved['pd_kv_load_failures_total{policy="recompute"}'] == 1 and moved["pd_kv_transfer_reads_total"] == 0
    text, logprobs = answer(complete(d, body))  # from D's prefix cache: its own KV
    assert text == reference[0] and logprobs == pytest.approx(reference[1], abs=1e-4)
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    http_client().post(f"{p.url}/v1/kv/release", json={"remote_request_id": kept["remote_request_id"],
                                                       "signature": kept["signature"]}, timeout=10)
    assert p.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
