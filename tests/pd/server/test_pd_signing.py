"""Who may make a decode server read KV, on real P and D servers with a shared secret:
unsigned, forged, replayed, expired or re-targeted parameters get a 403 and D connects
nowhere (a loopback listener records every connection); signed ones are served, once.
Without a secret, D reads only from its allowed peers."""

from __future__ import annotations

import time

import httpx
import pytest

from launch import http_client
from proxy.body import export_body, prefill_body
from tests.support.listeners import ConnectionRecorder
from tests.support.server_harness import wait_until

pytestmark = pytest.mark.slow
SECRET = "test-deployment-secret"
UNSIGNED = ("--kv-transfer-secret", "", "--allow-unsigned-kv-params")  # not the run's secret: none
BODY = {"prompt": "The keeper counted ships until the lamp went out. " * 3, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture
def recorder():
    recorder = ConnectionRecorder()
    yield recorder
    recorder.close()


def post(server, body: dict) -> httpx.Response:
    return http_client().post(f"{server.url}/v1/completions", json=body, timeout=60)


def prefill(p, body: dict = BODY) -> dict:
    response = post(p, {"kv_transfer_params": {"do_remote_decode": True}} | body)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def assert_refused(d, body: dict, why: str, param: str = "kv_transfer_params") -> None:
    response = post(d, body)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_transfer_params_refused" and why in error["message"], error
    assert error["param"] == param, error


def test_signed_parameters_are_served_once_and_nothing_else_reaches_a_peer(start, recorder) -> None:
    p, d = start.all(("p", "--role", "prefill", "--kv-transfer-secret", SECRET),
                     ("d", "--role", "decode", "--kv-transfer-secret", SECRET))
    reference = post(p, BODY).json()["choices"][0]["text"]
    params = prefill(p)
    assert len(params["signature"]) == 64 and len(params["prompt_digest"]) == 64
    at_recorder = params | {"remote_port": recorder.port}
    assert_refused(d, BODY | {"kv_transfer_params": at_recorder}, "does not match")  # forged: re-pointed
    unsigned = {k: v for k, v in at_recorder.items() if k != "signature"}
    assert_refused(d, BODY | {"kv_transfer_params": unsigned}, "not signed")
    other_blocks = params | {"remote_block_ids": [[b + 1 for b in ids] for ids in params["remote_block_ids"]]}
    assert_refused(d, BODY | {"kv_transfer_params": other_blocks}, "does not match")
    same_length = BODY | {"prompt": BODY["prompt"].replace("ships", "boats")}
    assert_refused(d, same_length | {"kv_transfer_params": params}, "another prompt")
    response = post(d, BODY | {"kv_transfer_params": params})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == reference
    assert d.metrics()["pd_kv_transfer_reads_total"] == 1
    assert_refused(d, BODY | {"kv_transfer_params": params}, "used already")  # replayed
    assert recorder.accepted == 0
    assert d.metrics()["pd_kv_transfer_reads_total"] == 1 and d.metrics()["pd_kv_cache_usage"] == 0


def test_expired_parameters_are_refused(start) -> None:
    p, d = start.all(("p", "--role", "prefill", "--kv-transfer-secret", SECRET, "--kv-lease-seconds", "1"),
                     ("d", "--role", "decode", "--kv-transfer-secret", SECRET))
    params = prefill(p)
    time.sleep(1.2)
    assert_refused(d, BODY | {"kv_transfer_params": params}, "expired")
    assert d.metrics()["pd_kv_transfer_failures_total"] == 0


def test_without_a_secret_d_reads_only_from_allowed_peers(start) -> None:
    recorder = ConnectionRecorder("127.0.0.2")
    try:
        p, d = start.all(("p", "--role", "prefill", *UNSIGNED),
                         ("d", "--role", "decode", *UNSIGNED, "--kv-allowed-peers", "127.0.0.1/32"))
        params = prefill(p)
        elsewhere = params | {"remote_host": "127.0.0.2", "remote_port": recorder.port}
        assert_refused(d, BODY | {"kv_transfer_params": elsewhere}, "not an allowed peer")
        assert recorder.accepted == 0
        response = post(d, BODY | {"kv_transfer_params": params})  # 127.0.0.1 is allowed
        assert response.status_code == 200 and d.metrics()["pd_kv_transfer_reads_total"] == 1
    finally:
        recorder.close()


def test_only_the_holder_of_the_parameters_may_release_their_blocks(start) -> None:
    """Issue 31 row 3: POST /v1/kv/release from anyone with the request id freed blocks a
    decode server was still to read. With a secret, it takes the parameters' signature."""
    p = start("p", "--role", "prefill", "--kv-transfer-secret", SECRET)
    params = prefill(p)
    release = lambda body: http_client().post(f"{p.url}/v1/kv/release", json=body, timeout=10)  # noqa: E731
    for body in ({"remote_request_id": params["remote_request_id"]},
                 {"remote_request_id": params["remote_request_id"], "signature": "0" * 64}):
        response = release(body)
        assert response.status_code == 403 and response.json()["error"]["code"] == "not_the_holder", response.text
    assert p.metrics()["pd_kv_requests_held"] == 1
    bad = http_client().post(f"{p.url}/v1/kv/release", content=b'{"remote_request_id": "\xff"}', timeout=10)
    assert bad.status_code == 400  # a string that is not UTF-8 was a 500
    response = release({"remote_request_id": params["remote_request_id"], "signature": params["signature"]})
    assert response.status_code == 200 and response.json() == {"released": True}
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0


def test_unsigned_parameters_naming_other_blocks_never_reach_d_s_prefix_cache(start) -> None:
    """Issue 31 row 6: parameters sent straight to a D without a secret, naming other
    blocks of P (held under another request), made D cache them under the attacker's
    prompt: a later ordinary request for that prompt answered wrongly."""
    p, d, c = start.all(("p", "--role", "prefill", *UNSIGNED), ("d", "--role", "decode", *UNSIGNED), ("c",))
    body = BODY | {"logprobs": 0}
    other = body | {"prompt": BODY["prompt"].replace("keeper", "sailor").replace("lamp", "moon")}
    answer = lambda r: (r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]["token_logprobs"])  # noqa
    reference = answer(post(c, body))
    params, victim = prefill(p, body), prefill(p, other)
    forged = params | {"remote_block_ids": victim["remote_block_ids"]}  # the other prompt's KV under this one's
    assert post(d, body | {"kv_transfer_params": forged}).status_code == 200  # its own answer: whatever it asked
    text, logprobs = answer(post(d, body))  # an ordinary request of that prompt, served by D alone
    assert text == reference[0] and logprobs == pytest.approx(reference[1], abs=1e-4)
    post(d, other | {"kv_transfer_params": victim})  # reads, and frees, the other's blocks
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_forged_parameters_naming_many_engines_that_never_answer_do_not_delay_a_real_one(start) -> None:
    """Issue 31 row 6: 40 forged engine ids, each at a listener that never answers,
    queued the handshakes 4 at a time: a request from a real P behind them waited 49 s.
    Handshakes now never queue: the real one is answered while the forged ones still
    wait for their handshakes' timeout."""
    from concurrent.futures import ThreadPoolExecutor

    p, d = start.all(("p", "--role", "prefill", *UNSIGNED), ("d", "--role", "decode", *UNSIGNED))
    holes = [ConnectionRecorder() for _ in range(40)]
    try:
        params = prefill(p)
        forged = [params | {"remote_engine_id": f"pd-forged-{k}", "remote_port": hole.port}
                  for k, hole in enumerate(holes)]
        real_body = BODY | {"prompt": BODY["prompt"] + " Again."}
        finished: list[str] = []

        def send(kind: str, body: dict) -> None:
            post(d, body)
            finished.append(kind)

        with ThreadPoolExecutor(len(holes) + 1) as pool:
            for kv in forged:
                pool.submit(send, "forged", BODY | {"kv_transfer_params": kv})
            assert wait_until(lambda: sum(h.accepted for h in holes) == len(holes), 30), "not all under way"
            real = real_body | {"kv_transfer_params": prefill(p, real_body)}
            pool.submit(send, "real", real).result(timeout=120)
            assert finished == ["real"]  # the forged ones still wait for their handshakes
        assert finished.count("forged") == len(holes) and d.metrics()["pd_kv_transfer_reads_total"] == 1
    finally:
        for hole in holes:
            hole.close()


def test_a_prefix_for_p_to_read_from_d_is_held_to_the_same_rules(start, recorder) -> None:
    """kv_transfer_params.prefix (a decode server's parameters for a prefix of the prompt,
    issue 34): P refuses forged, unsigned, re-targeted and replayed ones, and one of
    another prompt, naming the field, before connecting anywhere; a prefix that leaves
    nothing to compute is a 400; a signed one is read once."""
    p, d = start.all(("p", "--role", "prefill", "--kv-transfer-secret", SECRET),
                     ("d", "--role", "decode", "--kv-transfer-secret", SECRET))
    ids = http_client().post(f"{p.url}/v1/tokenize", json={"prompt": BODY["prompt"]}, timeout=10).json()["tokens"]
    body = BODY | {"prompt": ids}
    prefix = post(d, export_body(body, ids[:16])).json()["kv_transfer_params"]
    at_recorder = prefix | {"remote_port": recorder.port}
    for bad, why in [(at_recorder, "does not match"),
                     ({k: v for k, v in at_recorder.items() if k != "signature"}, "not signed")]:
        assert_refused(p, prefill_body(body, bad), why, "kv_transfer_params.prefix")
    assert_refused(p, prefill_body(body | {"prompt": ids[1:] + ids[:1]}, prefix), "another prompt",
                   "kv_transfer_params.prefix")
    whole = post(p, prefill_body(body | {"prompt": ids[:16]}, prefix))
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "kv_transfer_params.prefix.num_prompt_tokens"
    held = prefill(p, body | {"kv_transfer_params": prefill_body(body, prefix)["kv_transfer_params"]})
    assert p.metrics()['pd_prompt_tokens_by_source_total{source="remote"}'] == 16
    http_client().post(f"{p.url}/v1/kv/release", timeout=10,  # no decode server reads P's blocks here
                       json={"remote_request_id": held["remote_request_id"], "signature": held["signature"]})
    assert_refused(p, prefill_body(body, prefix), "used already", "kv_transfer_params.prefix")  # replayed
    assert recorder.accepted == 0
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
