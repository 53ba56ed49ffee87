"""Transfer metrics on real P and D servers: after PD requests they appear on /metrics
and move by the right amounts (histogram counts and sums against the counters, prompt
tokens by source against the usage)."""

from __future__ import annotations

import contextlib
import os

import pytest

from launch import http_client
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow
BODY = {"prompt": "The keeper counted ships until the lamp went out. " * 6, "max_tokens": 3, "temperature": 0}


def pd_request(p, d) -> dict:
    params = http_client().post(f"{p.url}/v1/completions", timeout=60, json=BODY | {
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    response = http_client().post(f"{d.url}/v1/completions", json=BODY | {"kv_transfer_params": params}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_transfer_metrics_move_by_the_right_amounts(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(running_server(tiny_models["bamba"], tmp_path / "p.log", "--role", "prefill"))
        d = stack.enter_context(running_server(tiny_models["bamba"], tmp_path / "d.log", "--role", "decode"))
        usage = pd_request(p, d)
        prompt = usage["prompt_tokens"]
        m = d.metrics()
        assert m["pd_kv_transfer_xfer_time_seconds_count"] == 1 and m["pd_kv_transfer_post_time_seconds_count"] == 1
        assert m["pd_kv_transfer_bytes_per_read_sum"] == m["pd_kv_transfer_bytes_total"] > 0
        assert m['pd_kv_transfer_bytes_by_path_total{path="cma"}'] == m["pd_kv_transfer_bytes_total"]  # one host
        assert p.metrics()["pd_kv_transfer_handshakes_refused_total"] == 0
        assert m["pd_kv_transfer_descriptors_per_read_sum"] == m["pd_kv_transfer_descriptors_total"] > 0
        assert m["pd_kv_transfer_handshakes_total"] == 1 and m["pd_kv_transfer_handshake_time_seconds_count"] == 1
        assert m['pd_kv_transfer_xfer_time_seconds_bucket{le="+Inf"}'] == 1
        assert m['pd_prompt_tokens_by_source_total{source="remote"}'] == prompt
        assert m['pd_prompt_tokens_by_source_total{source="computed"}'] == 0
        assert p.metrics()['pd_prompt_tokens_by_source_total{source="computed"}'] == prompt
        pd_request(p, d)  # the same prompt again: D's own prefix cache serves part of it
        m = d.metrics()
        local, remote = (m[f'pd_prompt_tokens_by_source_total{{source="{s}"}}'] for s in ("local_cache", "remote"))
        assert local > 0 and local + remote == 2 * prompt
        assert m["pd_kv_transfer_xfer_time_seconds_count"] == 2 and m["pd_kv_transfer_handshakes_total"] == 1
