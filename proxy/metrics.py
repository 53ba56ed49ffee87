"""The proxy's /metrics: per-instance state, requests answered and KV releases."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.instances import InstancePool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RELEASE_RESULTS = ("released", "unknown", "failed")  # P freed blocks / held none by that id / no answer


class InstanceCollector(Collector):
    """Per-instance health, outstanding requests, requests sent and failures."""

    def __init__(self, pools: list[InstancePool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["url", "role"]
        healthy = GaugeMetricFamily("pd_proxy_instance_healthy", "1 if the instance is taken for requests.",
                                    labels=labels)
        outstanding = GaugeMetricFamily("pd_proxy_instance_outstanding", "Requests in flight on the instance.",
                                        labels=labels)
        sent = CounterMetricFamily("pd_proxy_instance_requests", "Requests sent to the instance.", labels=labels)
        failed = CounterMetricFamily("pd_proxy_instance_failures", "Failures that marked the instance unhealthy.",
                                     labels=labels)
        for pool in self.pools:
            for i in pool.instances:
                healthy.add_metric([i.url, i.role], int(i.healthy))
                outstanding.add_metric([i.url, i.role], i.outstanding)
                sent.add_metric([i.url, i.role], i.requests)
                failed.add_metric([i.url, i.role], i.failures)
        yield from (healthy, outstanding, sent, failed)


class ProxyMetrics:
    def __init__(self, pools: list[InstancePool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(InstanceCollector(pools))
        self.requests = Counter("pd_proxy_requests", "Requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)
        self.kv_releases = Counter("pd_proxy_kv_releases",
                                   "Prefill servers asked to free a request's blocks that no decode server will "
                                   "read, by result: released, unknown (P held none by that id), failed.",
                                   ["result"], registry=self.registry)
        for result in RELEASE_RESULTS:
            self.kv_releases.labels(result=result)

    def exposition(self) -> bytes:
        """The text /metrics answers."""
        return generate_latest(self.registry)
