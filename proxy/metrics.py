"""The proxy's /metrics: per-instance state (breakers included), each role's policy, requests
answered and how long they took as their clients saw it, retries, 429s, KV releases and the
overlap routing expected and found."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.canary import RESULTS as CANARY_RESULTS
from proxy.disagg import PATHS
from proxy.fleet import ACTIONS as FLEET_ACTIONS
from proxy.instances import InstancePool
from proxy.migration import OUTCOMES as MIGRATION_OUTCOMES
from proxy.migration import REASONS as MIGRATION_REASONS
from wire.fleet import DECISION_ACTIONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROLES = ("prefill", "decode")
RELEASE_RESULTS = ("released", "unknown", "failed")  # P freed blocks / held none by that id / no answer
OVERLAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
CACHED_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # the servers' (pd/server/metrics.py), so that the two compare
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class InstanceCollector(Collector):
    """Per-instance health, outstanding requests, requests sent and failures; the policy
    that picks among each role's instances."""

    def __init__(self, pools: list[InstancePool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["url", "role"]
        healthy = GaugeMetricFamily("pd_proxy_instance_healthy", "1 if the instance is taken for requests.",
                                    labels=labels)
        outstanding = GaugeMetricFamily("pd_proxy_instance_outstanding", "Requests in flight on the instance.",
                                        labels=labels)
        sent = CounterMetricFamily("pd_proxy_instance_requests", "Requests sent to the instance.", labels=labels)
        failed = CounterMetricFamily("pd_proxy_instance_failures", "Failures counted against the instance's breaker.",
                                     labels=labels)
        breaker = GaugeMetricFamily("pd_proxy_instance_breaker_state", "The instance's circuit breaker: 0 closed, "
                                    "1 half-open (one trial may go), 2 open (nothing is sent to it).", labels=labels)
        draining = GaugeMetricFamily("pd_proxy_instance_draining", "1 if the instance is draining: it takes no new "
                                     "request (the admin API, its own registration, or its removal).", labels=labels)
        indexed = GaugeMetricFamily("pd_proxy_instance_kv_blocks", "Blocks the instance's KV events say it holds "
                                    "(kv_aware; absent for an instance whose events are not followed).",
                                    labels=labels)
        for pool in self.pools:
            for i in pool.instances:
                healthy.add_metric([i.url, i.role], int(i.healthy))
                outstanding.add_metric([i.url, i.role], i.outstanding)
                sent.add_metric([i.url, i.role], i.requests)
                failed.add_metric([i.url, i.role], i.failures)
                breaker.add_metric([i.url, i.role], i.breaker.gauge)
                draining.add_metric([i.url, i.role], int(i.draining))
                if i.kv_index is not None:
                    indexed.add_metric([i.url, i.role], len(i.kv_index.blocks))
        yield from (healthy, outstanding, sent, failed, breaker, draining, indexed)
        yield self._policies()

    def _policies(self) -> Metric:
        """pd_proxy_policy{role,policy} 1: an info gauge, to label routing decisions
        (pd_proxy_instance_requests_total) by the policy that made them."""
        family = GaugeMetricFamily("pd_proxy_policy", "1 for the policy that picks among each role's instances.",
                                   labels=["role", "policy"])
        for pool in self.pools:
            family.add_metric([pool.role, pool.policy], 1)
        return family


class ProxyMetrics:
    def __init__(self, pools: list[InstancePool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(InstanceCollector(pools))
        self.requests = Counter("pd_proxy_requests", "Requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "pd_proxy_time_to_first_token_seconds", "Seconds from a streamed request's arrival at the proxy to the "
            "first bytes of its answer sent back: what its client waited (queue, prefill, KV read, first token).",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "pd_proxy_request_latency_seconds", "Seconds from a request's arrival at the proxy to the end of its "
            "answer (a stream's last bytes), for requests answered 200.", buckets=E2E_BUCKETS, registry=self.registry)
        self.kv_releases = self._counter("pd_proxy_kv_releases",
                                         "Prefill servers asked to free a request's blocks that no decode server "
                                         "will read, by result: released, unknown (P held none by that id), failed.",
                                         "result", RELEASE_RESULTS)
        self.routed_overlap = Histogram("pd_proxy_routed_overlap_blocks",
                                        "Blocks of the prompt the chosen instance was expected to hold (its KV "
                                        "events), per role.", ["role"], buckets=OVERLAP_BUCKETS, registry=self.registry)
        self.prefill_cached = Histogram("pd_proxy_prefill_cached_tokens",
                                        "Prompt tokens the chosen prefill server then said it found in its prefix "
                                        "cache (its answer's usage).", buckets=CACHED_BUCKETS, registry=self.registry)
        self.kv_events_malformed = Counter("pd_proxy_kv_events_malformed",
                                           "KV event batches or replays received from a server that were not "
                                           "ones (dropped).", ["url"], registry=self.registry)

        self.paths = self._counter("pd_proxy_requests_by_path", "Requests placed, by where their prompt is "
                                   "computed: disaggregated (a prefill server), local (the decode server, "
                                   "--disagg-policy conditional) or disaggregated+reuse (a prefill server, after "
                                   "reading the prefix the decode server holds).", "path", PATHS)
        self.reuse_fallbacks = self._counter("pd_proxy_reuse_fallbacks", "Requests chosen for disaggregated+reuse "
                                             "that were prefilled without the decode server's prefix, by reason: "
                                             "export (the decode server did not export it) or refused (the prefill "
                                             "server refused it).", "reason", ("export", "refused"))
        self.retries = self._counter("pd_proxy_retries", "Requests sent again to another server after one failed, "
                                     "by role.", "role", ROLES)
        self.overloaded = self._counter("pd_proxy_overloaded", "Requests answered 429: every instance of the role "
                                        "had --max-outstanding requests in flight.", "role", ROLES)
        self.fleet_changes = self._counter("pd_proxy_fleet_changes", "Changes of the fleet's membership, by action: "
                                           "joined, renewed (a registration's lease), drained, undrained, removed, "
                                           "expired (its lease ended), role (moved to the other role).", "action",
                                           FLEET_ACTIONS)
        self.planner_decisions = self._counter("pd_proxy_planner_decisions", "Decisions a planner reported (pd "
                                               "planner): switch (a server given the other role), hold (a move "
                                               "wanted, not yet made: patience or cool-down).", "action",
                                               DECISION_ACTIONS)
        self.queued = Counter("pd_proxy_queued", "Requests that waited in the proxy's queue for room (every "
                              "server full, or every prefill server holding too much).", registry=self.registry)
        self.queue_refused = self._counter("pd_proxy_queue_refused", "Requests answered 429 past the queue's "
                                           "bounds, by reason: full (--max-queue) or timeout (--queue-timeout).",
                                           "reason", ("full", "timeout"))
        self.queue_waiting = Gauge("pd_proxy_queue_waiting", "Requests waiting in the proxy's queue now.",
                                   registry=self.registry)
        self.canary = self._counter("pd_proxy_canary", "PD requests run again colocated (--canary-fraction), by "
                                    "result: match, tie (they differ first at a token whose two most likely were "
                                    "within --canary-tie-logprob), mismatch, error (no colocated answer), skipped "
                                    "(past --canary-max-inflight, or no server to run it).", "result",
                                    CANARY_RESULTS)
        self._migration_metrics()

    def _migration_metrics(self) -> None:
        """Requests moved to another decode server (proxy/migration.py)."""
        self.migrations = Counter("pd_proxy_migrations", "Requests taken to another decode server after theirs "
                                  "failed them midway (--migration-limit) or handed them on, by reason (connection: "
                                  "lost or timed out; engine_died; gone: out of the fleet, its lease ended; drain: "
                                  "its server drained and handed the stream on with its KV) and outcome: moved (a "
                                  "stream, the new server reading its KV), resumed (a stream, from the tokens its "
                                  "client had, computed again), replayed (sent again whole: nothing had reached the "
                                  "client), failed (not migrated: the limit, no decode server left, a stream that "
                                  "cannot be resumed).",
                                  ["reason", "outcome"], registry=self.registry)
        for reason in MIGRATION_REASONS:
            for outcome in MIGRATION_OUTCOMES:
                self.migrations.labels(reason=reason, outcome=outcome)
        self.migrated_tokens = self._counter("pd_proxy_migrated_tokens", "Tokens of migrated requests, by how the "
                                             "new decode server got their KV: replayed (generated tokens computed "
                                             "again from their ids), moved (prompt and generated tokens whose KV it "
                                             "read from the server that handed the stream on).", "how",
                                             ("replayed", "moved"))
        self.migration_pause = Histogram("pd_proxy_migration_pause_seconds", "Seconds a resumed stream stood "
                                         "still: from its decode server's failure to the first bytes from the "
                                         "next.", buckets=PAUSE_BUCKETS, registry=self.registry)

    def _counter(self, name: str, documentation: str, label: str, values: Iterable[str]) -> Counter:
        """A counter by one label, each of `values` exposed (at 0) before it is first counted."""
        counter = Counter(name, documentation, [label], registry=self.registry)
        for value in values:
            counter.labels(value)
        return counter

    def observe_answer(self, ttft_s: float | None, total_s: float) -> None:
        """A request answered 200: its time to first bytes (streamed) and to its end."""
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        self.request_latency.observe(total_s)

    def exposition(self) -> bytes:
        """The text /metrics answers."""
        return generate_latest(self.registry)
