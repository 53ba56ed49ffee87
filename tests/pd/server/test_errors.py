"""Bad requests, the API key and disconnecting clients, against one real `pd serve`
(qwen3, `--api-key`): every refusal is a 4xx OpenAI error object,
the server stays healthy, and a client that leaves frees its request's KV blocks."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from launch import http_client
from tests.support.malformed import BAD_REQUESTS, MAX_MODEL_LEN
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# max_tokens of a request interrupted midway: it would run for tens of seconds, so its
# blocks are freed within the tests' few seconds only if it was aborted.
LONG = 3000


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-errors") / "server.log"
    with running_server(tiny_models["qwen3"], log, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
                        "--kv-cache-memory", str(32 << 20)) as server:
        server.first_engine_pid = server.health().json()["engine_pid"]
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_a_4xx_openai_error_and_the_server_stays_healthy(server, http, name) -> None:
    path, body, headers = BAD_REQUESTS[name]
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http.post(path, headers={"Content-Type": "application/json"} | headers, **kwargs)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    if "unknown model" in name:
        assert (response.status_code, error["code"]) == (404, "model_not_found")
    health = server.health()
    assert health.status_code == 200 and health.json()["engine_pid"] == server.first_engine_pid


def test_good_requests_still_work_after_the_bad_ones(http) -> None:
    for top_k in (0, -1, 5):  # 0 and -1 mean "no limit"
        response = http.post("/v1/completions", json={"model": "qwen3", "prompt": "Hello", "max_tokens": 3,
                                                      "top_k": top_k, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}], "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_api_key_guards_v1_only(server) -> None:
    body = {"model": "qwen3", "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            response = http_client().request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert http_client().post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    assert http_client().get(f"{server.url}/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert http_client().get(f"{server.url}/health", timeout=30).status_code == 200
    assert "pd_kv_cache_usage" in http_client().get(f"{server.url}/metrics", timeout=30).text


def wait_until_running(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics()["pd_kv_cache_usage"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def long_body(stream: bool) -> dict:
    return {"model": "qwen3", "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def test_client_disconnect_mid_stream_frees_the_blocks(server, http) -> None:
    with http.stream("POST", "/v1/completions", json=long_body(stream=True)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["pd_kv_cache_usage"] > 0
    # Leaving the `with` closed the connection with ~LONG tokens still to come.
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    assert server.metrics()['pd_request_success_total{finish_reason="length"}'] >= 0
    assert server.health().status_code == 200


def test_client_disconnect_while_waiting_for_a_full_response_aborts_it(server) -> None:
    raw = json.dumps(long_body(stream=False)).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
        wait_until_running(server)
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    assert server.metrics()["pd_num_requests_running"] == 0


def test_request_id_in_flight_cannot_be_reused(server, http) -> None:
    headers = {"X-Request-Id": "same-id"}
    with http.stream("POST", "/v1/completions", json=long_body(stream=True), headers=headers) as response:
        assert response.status_code == 200 and response.headers["x-request-id"] == "same-id"
        second = http.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "max_tokens": 1},
                           headers=headers)
        assert second.status_code == 400 and second.json()["error"]["code"] == "duplicate_request_id"
    server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0)
    again = http.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "max_tokens": 1}, headers=headers)
    assert again.status_code == 200, again.text
