"""Who may make a decode server read KV, on real P and D servers with a shared secret:
unsigned, forged, replayed, expired or re-targeted parameters get a 403 and D connects
nowhere (a loopback listener records every connection); signed ones are served, once.
Without a secret, D reads only from its allowed peers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from launch import http_client

pytestmark = pytest.mark.slow
SECRET = "test-deployment-secret"
BODY = {"prompt": "The keeper counted ships until the lamp went out. " * 3, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}


class ConnectionRecorder:
    """A loopback listener that accepts connections, records them and never answers."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self.accepted = 0
        self.open: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                self.accepted += 1
                self.open.append(conn)

    def close(self) -> None:
        self.server.close()
        for conn in self.open:
            conn.close()


@pytest.fixture
def recorder():
    recorder = ConnectionRecorder()
    yield recorder
    recorder.close()


def post(server, body: dict) -> httpx.Response:
    return http_client().post(f"{server.url}/v1/completions", json=body, timeout=60)


def prefill(p, body: dict = BODY) -> dict:
    response = post(p, body | {"kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def assert_refused(d, body: dict, why: str) -> None:
    response = post(d, body)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_transfer_params_refused" and why in error["message"], error


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
        p, d = start.all(("p", "--role", "prefill"), ("d", "--role", "decode", "--kv-allowed-peers", "127.0.0.1/32"))
        params = prefill(p)
        elsewhere = params | {"remote_host": "127.0.0.2", "remote_port": recorder.port}
        assert_refused(d, BODY | {"kv_transfer_params": elsewhere}, "not an allowed peer")
        assert recorder.accepted == 0
        response = post(d, BODY | {"kv_transfer_params": params})  # 127.0.0.1 is allowed
        assert response.status_code == 200 and d.metrics()["pd_kv_transfer_reads_total"] == 1
    finally:
        recorder.close()
