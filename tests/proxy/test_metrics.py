"""The proxy's /metrics exposition, on pools of its own (no server): each role's policy
and the per-instance families a dashboard reads."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from proxy.instances import InstancePool
from proxy.metrics import ProxyMetrics


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
