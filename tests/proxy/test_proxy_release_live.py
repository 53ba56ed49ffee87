"""A decode server that refuses what its prefill server accepted (here: a shorter
context), behind the real proxy: the client gets D's 400, and P frees the request's
blocks at once on the proxy's release instead of holding them for the 60 s lease."""

from __future__ import annotations

import contextlib
import os

import pytest

from launch import http_client
from tests.support.server_harness import running_proxy, running_server

pytestmark = pytest.mark.slow


def test_p_frees_at_once_what_d_refused(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "p.log", "--role", "prefill"))
        d = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "d.log", "--role", "decode",
                                               "--max-model-len", "128"))
        proxy = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url))
        body = {"prompt": list(range(10, 210)), "max_tokens": 4}  # fits P's context, not D's
        response = http_client().post(f"{proxy.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
        assert p.metrics()["pd_kv_transfer_released_total"] == 1
        assert p.metrics()["pd_kv_transfer_leases_expired_total"] == 0
        assert p.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
        metrics = http_client().get(f"{proxy.url}/metrics", timeout=10).text
        assert 'pd_proxy_kv_releases_total{result="released"} 1.0' in metrics
        ok = http_client().post(f"{proxy.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
