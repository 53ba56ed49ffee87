"""Faults from outside, against real `pd serve` processes (qwen3 and the bamba hybrid):
each test does the bad thing and then asserts the engine is the same process, still
serving, with its KV back to 0.

- Malformed PD parameters sent to a decode server (they used to kill its engine core).
- Bodies that cost work or memory: over the size limit, too many characters to fit.
- A prefill server's held blocks: capped, refused past the cap with 503 + Retry-After,
  released at once on request; a body a decode server would refuse is refused by P
  before it prefills.
- A dead engine: /health and /metrics say so, with no stale figures.
- One `--role both` server as P and D of the same request id.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from launch import http_client
from tests.support.server_harness import running_server, wait_until

pytestmark = pytest.mark.slow
PROMPT = "A lighthouse keeper wrote down every ship that passed the rocks. " * 3
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
MAX_MODEL_LEN = 1024


def _starter(stack: contextlib.ExitStack, tiny_models, logs):
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return lambda name, arch, *args: stack.enter_context(running_server(
        tiny_models[arch], logs / f"{name}.log", "--max-model-len", str(MAX_MODEL_LEN), *args))


@pytest.fixture
def start(tiny_models, tmp_path):
    """Servers for one test (it kills them or gives them flags of their own)."""
    with contextlib.ExitStack() as stack:
        yield _starter(stack, tiny_models, tmp_path)


@pytest.fixture(scope="module")
def prefill_server(tiny_models, tmp_path_factory):
    """One qwen3 `--role prefill` server for the tests that leave it as they found it
    (each checks that it holds nothing afterwards)."""
    with contextlib.ExitStack() as stack:
        yield _starter(stack, tiny_models, tmp_path_factory.mktemp("faults"))("p", "qwen3", "--role", "prefill")


def post(server, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return http_client().post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def assert_serving(server, pid: int) -> None:
    """The same engine process, answering a good request, its KV back to 0."""
    assert server.engine_pid == pid
    response = post(server, BODY)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def prefill(p, body: dict = BODY) -> dict:
    response = post(p, body | {"kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def without(params: dict, key: str) -> dict:
    return {k: v for k, v in params.items() if k != key}


# name -> (how to spoil P's parameters, the field the 400 names)
BAD_PARAMS = {
    "first_token_ids missing": (lambda p: without(p, "first_token_ids"), "first_token_ids"),
    "first_token_ids outside the vocabulary": (lambda p: p | {"first_token_ids": [10**6]}, "first_token_ids"),
    "first_token_ids a string": (lambda p: p | {"first_token_ids": ["5"]}, "first_token_ids"),
    "first_token_ids negative": (lambda p: p | {"first_token_ids": [-7]}, "first_token_ids"),
    "first_token_ids empty": (lambda p: p | {"first_token_ids": []}, "first_token_ids"),
    "first_token_ids more than n": (lambda p: p | {"first_token_ids": p["first_token_ids"] * 2}, "first_token_ids"),
    "remote_port not a number": (lambda p: p | {"remote_port": "abc"}, "remote_port"),
    "remote_port null": (lambda p: p | {"remote_port": None}, "remote_port"),
    "remote_port out of range": (lambda p: p | {"remote_port": 65536}, "remote_port"),
    "an integer past 2**64": (lambda p: p | {"num_prompt_tokens": 2**70}, "num_prompt_tokens"),
    "a block id past 2**64": (lambda p: p | {"remote_block_ids": [[2**65] * len(ids) for ids in p["remote_block_ids"]]},
                              "remote_block_ids"),
    "block ids not lists": (lambda p: p | {"remote_block_ids": 5}, "remote_block_ids"),
    "lease not a number": (lambda p: p | {"lease_expires_at": "soon"}, "lease_expires_at"),
    "an unknown field": (lambda p: p | {"extra": 1}, "extra"),
}


@pytest.mark.parametrize("arch", ["qwen3", "bamba"])
def test_malformed_pd_parameters_get_a_400_naming_the_field_and_the_decode_engine_lives(start, arch) -> None:
    p, d = start("p", arch, "--role", "prefill"), start("d", arch, "--role", "decode")
    pid = d.engine_pid
    for name, (spoil, field) in BAD_PARAMS.items():
        for stream in (False, True):
            response = post(d, BODY | {"stream": stream, "kv_transfer_params": spoil(prefill(p))})
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == f"kv_transfer_params.{field}" and field in error["message"], (name, error)
            assert d.engine_pid == pid, name
    assert_serving(d, pid)
    # P frees the blocks of the parameters nobody read when their leases end; nothing else leaked
    assert p.metrics()["pd_kv_requests_held"] == 2 * len(BAD_PARAMS)


def test_a_chat_template_kwarg_that_collides_is_a_400_and_huge_integers_are_refused_or_clamped(prefill_server) -> None:
    server = prefill_server  # serves requests of its own too
    pid = server.engine_pid
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for kwargs in ({"messages": 1}, {"add_generation_prompt": "x"}):
        response = post(server, chat | {"chat_template_kwargs": kwargs}, "/v1/chat/completions")
        assert response.status_code == 400 and "chat_template_kwargs" in response.json()["error"]["message"]
    assert post(server, BODY | {"top_k": 2**70}).status_code == 200  # past the vocabulary: no limit
    for field in ("max_tokens", "seed", "stop_token_ids"):
        value = [2**70] if field == "stop_token_ids" else 2**70
        response = post(server, BODY | {field: value})
        assert response.status_code == 400, (field, response.text)
    assert_serving(server, pid)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        kb = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kb) * 1024


def test_oversized_bodies_are_refused_before_they_cost_cpu_or_memory(start) -> None:
    server = start("c", "qwen3", "--max-request-bytes", str(3 << 20))
    pid = server.engine_pid
    post(server, BODY)  # warm: first-request allocations are not a leak
    baseline = rss_bytes(server.process.pid)
    big = "lorem ipsum " * ((20 << 20) // 12)  # 20 MB
    response = post(server, {"prompt": big, "max_tokens": 1})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = http_client().post(f"{server.url}/v1/completions",
                                 content=iter([b'{"prompt": "', b"x" * (4 << 20), b'"}']),
                                 headers={"Content-Type": "application/json"}, timeout=60)  # no Content-Length
    assert chunked.status_code == 413
    for _ in range(3):  # just under the body limit, far past what the context can hold
        response = post(server, {"prompt": "lorem ipsum " * ((3 << 20) // 13), "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        chat = post(server, {"messages": [{"role": "user", "content": "x" * ((3 << 20) // 2)}]}, "/v1/chat/completions")
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert rss_bytes(server.process.pid) < baseline + (64 << 20)
    assert_serving(server, pid)


def test_p_caps_the_blocks_it_holds_for_decode_servers_and_releases_them_on_request(start) -> None:
    p = start("p", "bamba", "--role", "prefill", "--kv-cache-memory", str(48 << 20), "--kv-max-held-fraction", "0.3")
    pid = p.engine_pid
    params = []
    for i in range(100):
        response = post(p, BODY | {"prompt": f"{i} {PROMPT}", "kv_transfer_params": {"do_remote_decode": True}})
        if response.status_code == 503:
            break
        assert response.status_code == 200, response.text
        params.append(response.json()["kv_transfer_params"])
    else:
        pytest.fail("P never refused a prefill past its held share")
    assert response.json()["error"]["code"] == "kv_held_limit" and response.headers["retry-after"] == "1"
    assert len(params) >= 2 and p.metrics()["pd_kv_requests_held"] == len(params)
    assert post(p, BODY).status_code == 200  # its own requests are still served
    for held in params:
        release = post(p, {"remote_request_id": held["remote_request_id"], "signature": held["signature"]},
                       "/v1/kv/release")
        assert release.status_code == 200 and release.json() == {"released": True}
    assert post(p, {"remote_request_id": params[0]["remote_request_id"]}, "/v1/kv/release").json() == \
        {"released": False}
    assert post(p, {"remote_request_id": 5}, "/v1/kv/release").status_code == 400
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
    assert p.metrics()["pd_kv_transfer_released_total"] == len(params)
    again = prefill(p)  # accepted again
    assert post(p, {"remote_request_id": again["remote_request_id"], "signature": again["signature"]},
                "/v1/kv/release").json() == {"released": True}
    assert_serving(p, pid)


@pytest.mark.parametrize("refused", [{"max_tokens": MAX_MODEL_LEN}, {"min_tokens": 7}, {"max_tokens": -1},
                                     {"stream_options": {"include_usage": "yes"}}, {"n": 129},
                                     {"logprobs": 21}])
def test_p_refuses_what_d_would_refuse_before_it_prefills(prefill_server, refused) -> None:
    p = prefill_server
    response = post(p, BODY | refused | {"kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 400, response.text
    assert p.metrics()["pd_kv_requests_held"] == 0 and p.metrics()["pd_kv_cache_usage"] == 0


def test_while_a_new_engine_starts_health_and_metrics_show_no_stale_figures(start) -> None:
    server = start("c", "qwen3", "--restart-engine", "1", "--kv-connector", "nixl")
    assert server.metrics()["pd_engine_alive"] == 1 and "pd_num_requests_running" in server.metrics()
    os.kill(server.engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while server.health().status_code == 200:
        assert time.monotonic() < deadline, "the server never noticed its engine died"
        time.sleep(0.05)
    assert server.health().json()["status"] == "engine dead"  # a new one starts (a NIXL agent: a while)
    metrics = server.metrics()
    if metrics["pd_engine_restarts_total"] == 0:  # still starting: nothing of the dead engine shows
        assert metrics["pd_engine_alive"] == 0
        assert not any(k.startswith(("pd_num_requests", "pd_kv_cache_usage", "pd_prefix_cache")) for k in metrics)
        response = post(server, BODY)
        if response.status_code != 200:  # unless the new engine is up by now
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
            assert response.headers["retry-after"] == "1"
    assert wait_until(lambda: server.health().status_code == 200, 60)
    assert_serving(server, server.engine_pid)


def test_one_both_server_is_p_and_d_of_the_same_request_id(start) -> None:
    server = start("pd", "qwen3", "--kv-connector", "nixl")
    pid = server.engine_pid
    reference = post(server, BODY).json()["choices"][0]["text"]
    headers = {"X-Request-Id": "shared-id"}
    params = post(server, BODY | {"kv_transfer_params": {"do_remote_decode": True}}, headers=headers).json()
    response = post(server, BODY | {"kv_transfer_params": params["kv_transfer_params"]}, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference and response.json()["id"] == "shared-id"
    # its own blocks: released, then hit in its prefix cache rather than read over NIXL
    assert server.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
    assert server.metrics()["pd_kv_transfer_released_total"] == 1
    assert_serving(server, pid)


def test_any_bytes_to_the_kv_events_and_side_channel_ports_leave_the_engine_serving(start) -> None:
    """Row 2 of issue 31: four bytes (a msgpack map whose key is not UTF-8) to the KV
    events replay port killed the engine (UnicodeDecodeError escaped a handler that
    caught msgspec.DecodeError only). Now every listener drops and counts them."""
    import socket

    import zmq

    from launch import free_port

    events, replay, side = free_port(), free_port(), free_port()
    server = start("p", "qwen3", "--role", "prefill", "--kv-events-port", str(events), "--kv-events-replay-port",
                   str(replay), "--kv-side-channel-port", str(side))
    pid = server.engine_pid
    context = zmq.Context()
    try:
        for port, payloads in ((replay, [bytes.fromhex("81a1ff01"), b"\xc1", b"\x91" * 300]),
                               (side, [bytes.fromhex("81a1ff01"), b"\x00" * 2048])):
            dealer = context.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            for payload in payloads:
                dealer.send_multipart([b"", payload] if port == side else [payload])
            dealer.close(linger=1000)
        for port in (events, replay, side):  # not ZMTP at all
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(bytes(range(256)) * 4)
    finally:
        context.term()
    label = 'pd_malformed_messages_total{listener="%s"}'
    counted = lambda: server.metrics().get(label % "kv_events_replay", 0) + server.metrics().get(  # noqa: E731
        label % "side_channel", 0) == 5
    assert wait_until(lambda: server.health().status_code != 200 or counted())
    assert server.engine_pid == pid, "the engine died"
    assert server.metrics()[label % "kv_events_replay"] == 3 and server.metrics()[label % "side_channel"] == 2
    assert_serving(server, pid)


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_everything_rendered_into_a_prompt_is_held_to_the_character_cap_before_it_is_tokenized(prefill_server) -> None:
    """Issue 31 row 5: a 3.99 MB tools schema (under the 4 MiB body cap) was rendered and
    tokenized in full (3.35 M tokens, seconds of CPU) before the prompt was refused."""
    server = prefill_server
    pid = server.engine_pid
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "lorem ipsum " * 4}
                                               for i in range(40_000)}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    assert 3 << 20 < len(json.dumps(body)) < 4 << 20
    before = cpu_seconds(server.process.pid)
    for _ in range(3):
        response = post(server, body, "/v1/chat/completions")
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text[:300]
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert cpu_seconds(server.process.pid) - before < 2.0  # reading and parsing 12 MB of bodies, no tokenizing
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "y" * (3 << 20)}}
    response = post(server, kwargs, "/v1/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"
    assert_serving(server, pid)


def test_a_prompt_far_past_the_context_is_refused_from_the_tokens_of_its_start(prefill_server) -> None:
    server = prefill_server
    text = "ab " * 20_000  # under the character cap, ~20,000 tokens
    response = post(server, {"prompt": text, "max_tokens": 1})
    assert response.status_code == 400 and "its first 8192 characters alone have" in response.json()["error"]["message"]
