"""The proxy's /metrics exposition, on pools of its own (no server): each role's policy
and the per-instance families a dashboard reads; and, before fake servers, the latency
its clients saw."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import http_client
from proxy.instances import InstancePool
from proxy.metrics import ProxyMetrics
from tests.support.proxy_fakes import fake, proxy_in_front, proxy_metric


def samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by (name, sorted labels)."""
    text = metrics.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_each_role_s_policy_is_one_labelled_sample() -> None:
    prefill = InstancePool.of(["http://p1", "http://p2"], "prefill", "least_loaded")
    decode = InstancePool.of(["http://d1"], "decode", "kv_aware")
    got = samples(ProxyMetrics([prefill, decode]))
    policies = {labels: value for (name, labels), value in got.items() if name == "pd_proxy_policy"}
    assert policies == {(("policy", "least_loaded"), ("role", "prefill")): 1.0,
                        (("policy", "kv_aware"), ("role", "decode")): 1.0}


def test_requests_sent_and_breakers_are_per_instance() -> None:
    prefill = InstancePool.of(["http://p1", "http://p2"], "prefill", "round_robin")
    decode = InstancePool.of(["http://d1"], "decode", "round_robin")
    prefill.instances[1].requests = 3
    got = samples(ProxyMetrics([prefill, decode]))
    sent = {dict(labels)["url"]: value for (name, labels), value in got.items()
            if name == "pd_proxy_instance_requests_total"}
    assert sent == {"http://p1": 0.0, "http://p2": 3.0, "http://d1": 0.0}
    breakers = [value for (name, _), value in got.items() if name == "pd_proxy_instance_breaker_state"]
    assert breakers == [0.0, 0.0, 0.0]  # all closed


@pytest.mark.slow  # real sockets and servers
def test_the_latency_clients_see_is_counted_for_requests_answered_whole() -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url]) as proxy:
        assert http_client().post(f"{proxy}/v1/completions", json=body, timeout=30).status_code == 200
        assert http_client().post(f"{proxy}/v1/completions", json=body | {"stream": True}, timeout=30).status_code \
            == 200
        assert http_client().post(f"{proxy}/v1/completions", content=b"{", timeout=30).status_code == 400
        counts = [proxy_metric(proxy, f"pd_proxy_{name}_count")
                  for name in ("request_latency_seconds", "time_to_first_token_seconds")]
    assert counts == [2, 1]  # both 200s; only the stream has a first chunk; the 400 neither
