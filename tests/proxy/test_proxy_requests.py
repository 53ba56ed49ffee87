"""What the proxy accepts from a client and what it sends on, in front of fake servers:
the API key on every route but /health, strict JSON bodies and the size limit (each
refusal a JSON error, nothing sent to a server), the bodies P and D get, the stream
relayed byte for byte, and the `pd proxy` flags."""

from __future__ import annotations

import argparse
import socket

import httpx
import pytest

from launch import http_client
from proxy.body import prefill_body, token_id_prompt
from proxy.main import add_proxy_flags, proxy_config
from proxy.proxy_config import ProxyConfig
from tests.support.proxy_fakes import STREAM_CHUNKS, fake, proxy_in_front, proxy_metric
from wire.body import DEFAULT_LIMIT as MAX_REQUEST_BYTES

KEY, SERVER_KEY = "client-secret", "server-secret"
pytestmark = pytest.mark.slow  # seconds per test of real sockets, servers and timeouts
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9}
ROUTES = [("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}), ("POST", "/v1/chat/completions", CHAT),
          ("GET", "/v1/models", None), ("GET", "/metrics", None)]


@pytest.fixture
def servers():
    with fake("prefill") as p, fake("decode") as d:
        yield p, d


def send(proxy: str, method: str, path: str, body: dict | None, auth: str | None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else {}
    return http_client().request(method, proxy + path, json=body, headers=headers, timeout=30)


# ---- the API key ---------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[path for _, path, _ in ROUTES])
def test_every_route_but_health_needs_the_key(servers, method, path, body) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url], api_key=KEY, server_api_key=SERVER_KEY) as proxy:
        for auth in (None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY):
            response = send(proxy, method, path, body, auth)
            assert response.status_code == 401, (auth, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert p.received == d.received == []
        assert send(proxy, method, path, body, f"Bearer {KEY}").status_code == 200
        assert http_client().get(f"{proxy}/health", timeout=5).status_code == 200  # open without a key


def test_the_servers_get_the_server_key_not_the_clients(servers) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url], api_key=KEY, server_api_key=SERVER_KEY) as proxy:
        assert send(proxy, *ROUTES[0], f"Bearer {KEY}").status_code == 200
        sent = {p.received[0].headers["authorization"], d.received[0].headers["authorization"]}
        assert sent == {f"Bearer {SERVER_KEY}"}
        assert p.received[0].headers["x-request-id"] == d.received[0].headers["x-request-id"]


@pytest.mark.parametrize(("api_key", "server_api_key", "client_auth", "servers_get"), [
    (KEY, None, f"Bearer {KEY}", f"Bearer {KEY}"),  # the server key defaults to the client key
    (None, SERVER_KEY, "Bearer anything", f"Bearer {SERVER_KEY}"),
    (None, None, "Bearer the-clients-own", "Bearer the-clients-own"),  # passed on as before
    (None, None, None, None),
])
def test_what_authorization_the_servers_get(servers, api_key, server_api_key, client_auth, servers_get) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url], api_key=api_key, server_api_key=server_api_key) as proxy:
        assert send(proxy, *ROUTES[0], client_auth).status_code == 200
        assert p.received[0].headers.get("authorization") == servers_get
        assert d.received[0].headers.get("authorization") == servers_get


# ---- the body: strict JSON and its size ------------------------------------------------


@pytest.mark.parametrize(("raw", "code"), [
    (b'{"prompt": "Hi", "temperature": NaN}', "non_finite_number"),
    (b'{"prompt": "Hi", "temperature": Infinity}', "non_finite_number"),
    (b'{"prompt": "Hi", "temperature": -Infinity}', "non_finite_number"),
    (b'{"prompt": "Hi", "temperature": 1e309}', "non_finite_number"),
    (b'{"prompt": "\\ud800"}', "lone_surrogate"),
    (b'{"prompt": "Hi", "\\udfff": 1}', "lone_surrogate"),
    (b'{"prompt": "Hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}", "nesting_too_deep"),
    (b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nesting_too_deep"),
    (b'["Hi"]', "invalid_body"),
    (b'{"prompt": "\xff"}', "invalid_utf8"),
    (b'{"prompt": ', "invalid_json"),
])
def test_a_body_that_is_not_strict_json_is_a_400_and_reaches_no_server(servers, raw, code) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url]) as proxy:
        response = http_client().post(f"{proxy}/v1/chat/completions", content=raw, timeout=30,
                                      headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and response.headers["content-type"] == "application/json"
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["code"] == code
        assert p.received == d.received == []
        assert proxy_metric(proxy, 'pd_proxy_requests_total{endpoint="/v1/chat/completions",status="400"}') == 1


def padded(size: int) -> bytes:
    """A JSON body of exactly `size` bytes."""
    head = b'{"prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def test_a_body_over_the_limit_is_a_413_by_content_length_or_while_chunked(servers) -> None:
    p, d = servers
    limit = 1024
    with proxy_in_front([p.url], [d.url], max_request_bytes=limit) as proxy:
        big = padded(limit + 1)
        by_length = http_client().post(f"{proxy}/v1/completions", content=big, timeout=30)
        chunked = http_client().post(f"{proxy}/v1/completions", content=iter([big[:600], big[600:]]), timeout=30)
        for response in (by_length, chunked):
            assert response.status_code == 413
            assert response.json()["error"]["code"] == "request_too_large"
        assert "content-length" not in chunked.request.headers  # it was sent chunked
        assert p.received == d.received == []
        assert http_client().post(f"{proxy}/v1/completions", content=padded(limit), timeout=30).status_code == 200


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(servers) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url], max_request_bytes=1024) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000000\r\n\r\n" + padded(100))  # the rest never comes
            answer = b""
            while b"request_too_large" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 ") and b'"request_too_large"' in answer
        assert p.received == d.received == []


# ---- what the servers get, and what comes back --------------------------------------


def test_p_gets_the_original_body_unstreamed_and_d_gets_it_with_ps_params(servers) -> None:
    p, d = servers
    body = {"prompt": "caf\u00e9 \U0001f600", "max_tokens": 50, "min_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, "seed": 2**80, "temperature": 0.5, "extra": [1, {"a": None}]}
    with proxy_in_front([p.url], [d.url]) as proxy:
        with http_client().stream("POST", f"{proxy}/v1/completions", json=body, timeout=30,
                                  headers={"X-Request-Id": "rid-7"}) as response:
            raw = b"".join(response.iter_raw())
            assert response.status_code == 200 and response.headers["x-request-id"] == "rid-7"
    assert raw == b"".join(STREAM_CHUNKS)  # byte for byte
    assert p.received[0].body == body | {"stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    # and the token ids, which the proxy reads to resume the stream elsewhere if D fails (migration.py)
    assert d.received[0].body == body | {"kv_transfer_params": p.params(1), "return_token_ids": True}
    assert p.received[0].headers["x-request-id"] == d.received[0].headers["x-request-id"] == "rid-7"
    assert p.releases == []


def test_an_unstreamed_answer_is_ds_body(servers) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url]) as proxy:
        response = http_client().post(f"{proxy}/v1/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "fake answer"
        assert response.headers["x-request-id"].startswith("pdx-")
        assert p.received[0].path == d.received[0].path == "/v1/chat/completions"
        assert p.received[0].body["max_completion_tokens"] == 9  # kept: P caps do_remote_decode itself


def test_prefill_body_changes_only_stream_and_kv_transfer_params() -> None:
    body = {"prompt": "p", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True}}
    assert prefill_body(body) == body | {"stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["stream"] is True  # the client's body is not changed


# ---- flags ---------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    return parser.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *argv])


def test_the_flags_defaults_and_help() -> None:
    config = proxy_config(parse())
    assert config.max_request_bytes == MAX_REQUEST_BYTES == 4194304
    assert config.api_key is None and config.server_authorization is None
    assert proxy_config(parse("--api-key", "k")).server_authorization == "Bearer k"
    both = proxy_config(parse("--api-key", "k", "--server-api-key", "s", "--max-request-bytes", "10"))
    assert (both.api_key, both.server_authorization, both.max_request_bytes) == ("k", "Bearer s", 10)
    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    help_text = " ".join(parser.format_help().split())
    for words in ("--max-request-bytes N largest request body", "--server-api-key KEY sent to the prefill",
                  "--api-key KEY clients must send"):
        assert words in help_text


@pytest.mark.parametrize("argv", [("--max-request-bytes", "0"), ("--timeout", "0"), ("--api-key", ""),
                                  ("--probe-interval", "-1")])
def test_invalid_flags_stop_the_proxy_with_a_message(argv) -> None:
    with pytest.raises(SystemExit, match="pd proxy: "):
        proxy_config(parse(*argv))


def test_unknown_routes_and_methods_answer_an_openai_error_object(servers) -> None:
    p, d = servers
    with proxy_in_front([p.url], [d.url]) as proxy:
        for path in ("/nowhere", "/v1/completions"):
            response = http_client().get(f"{proxy}{path}", timeout=5)
            assert response.status_code in (404, 405)
            assert response.json()["error"]["message"] in ("Not Found", "Method Not Allowed")


def test_a_token_id_prompt_is_routed_on_its_ids_without_asking_a_server() -> None:
    assert token_id_prompt({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert token_id_prompt({"prompt": [[5, 6]]}) == [5, 6]  # a batch of one
    for body in ({"prompt": "text"}, {"prompt": []}, {"prompt": [5, True]}, {"prompt": [5.0]},
                 {"prompt": [[1], [2]]}, {"messages": [{"role": "user", "content": "hi"}]}):
        assert token_id_prompt(body) is None, body


def test_the_proxy_config_keeps_what_was_asked_and_derives_the_rest() -> None:
    """Unset phase timeouts and role policies are derived (no field rewritten after it was
    given, as the engine's config does)."""
    config = ProxyConfig(("http://p",), ("http://d",), timeout_s=30.0, decode_timeout_s=5.0, policy="least_loaded")
    assert (config.prefill_timeout_s, config.phase_timeout_s("prefill"), config.phase_timeout_s("decode")) == \
        (None, 30.0, 5.0)
    assert (config.prefill_policy, config.role_policy("prefill")) == (None, "least_loaded")
