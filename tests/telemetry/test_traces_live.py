"""One request through `pd proxy` to a real prefill and decode server (NIXL between them),
each exporting its spans over OTLP/HTTP to a receiver started here: one trace whose spans
cover the proxy, P, the KV read and D, with their parent links; and JSON log lines that
name the request and its trace."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from launch import http_client
from tests.support.otlp import otlp_receiver
from tests.support.server_harness import running_proxy, running_server, wait_until

pytestmark = pytest.mark.slow
MODEL = "qwen3"
PROMPT = "A lighthouse keeper wrote down every ship that passed the rocks. " * 3


def test_a_pd_request_is_one_trace_across_proxy_p_the_transfer_and_d(tiny_models, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the servers export within 50 ms of a span's end
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models[MODEL]
    with otlp_receiver() as (endpoint, spans), contextlib.ExitStack() as stack:
        traced = ("--otlp-traces-endpoint", endpoint, "--log-format", "json")
        p = stack.enter_context(running_server(model, tmp_path / "p.log", "--role", "prefill", *traced))
        d = stack.enter_context(running_server(model, tmp_path / "d.log", "--role", "decode", *traced))
        proxy = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  *traced))
        response = http_client().post(f"{proxy.url}/v1/completions", headers={"X-Request-Id": "traced-live"},
                                      json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0}, timeout=120)
        assert response.status_code == 200 and response.headers["x-pd-path"] == "disaggregated"
        names = {"proxy.request", "proxy.prefill", "proxy.decode", "pd.request", "pd.kv_read", "pd.decode"}
        assert wait_until(lambda: names <= {s.name for s in spans}, 30), sorted({s.name for s in spans})
    (root,) = [s for s in spans if s.name == "proxy.request"]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    assert len(trace) == len(spans)  # nothing else was sent: every span is this request's
    one = {(s.service, s.role, s.name): s for s in trace}
    proxy_prefill, proxy_decode = one["pd-proxy", None, "proxy.prefill"], one["pd-proxy", None, "proxy.decode"]
    assert root.parent_id == "" and root.attributes["pd.request_id"] == "traced-live"
    assert proxy_prefill.parent_id == root.span_id and proxy_decode.parent_id == root.span_id
    on_p, on_d = one["pd-serve", "prefill", "pd.request"], one["pd-serve", "decode", "pd.request"]
    assert on_p.parent_id == proxy_prefill.span_id and on_d.parent_id == proxy_decode.span_id
    assert {s.name for s in trace if s.parent_id == on_p.span_id} == {"pd.queue", "pd.prefill"}
    assert {s.name for s in trace if s.parent_id == on_d.span_id} == {"pd.queue", "pd.kv_read", "pd.decode"}
    read = one["pd-serve", "decode", "pd.kv_read"].attributes  # the transfer: P's blocks read
    assert read["pd.kv_tokens"] > 0 and read["pd.kv_bytes"] > 0 and read["pd.kv_descriptors"] > 0
    assert on_d.attributes["pd.output_tokens"] == 6 and on_d.attributes["pd.request_id"] == "traced-live"
    # where the prompt came from, as the client's usage says: P computed it (D read it from P)
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    for on in (on_p, on_d):
        assert on.attributes["pd.prompt_tokens.computed"] == prompt_tokens and on.attributes["pd.cached_tokens"] == 0
        assert on.attributes["pd.prompt_tokens.local_cache"] == 0
    for log in ("p.log", "d.log", "proxy.log"):  # every line a JSON record, start-up lines too
        text = [line for line in (tmp_path / log).read_text().splitlines() if not line.startswith("{")]
        assert not text, (log, text[:5])
    lines = [json.loads(line) for line in (tmp_path / "d.log").read_text().splitlines()]
    named = [line for line in lines if line.get("request_id") == "traced-live"]
    assert named and all(line["trace_id"] == root.trace_id for line in named)
