"""Prometheus metrics of one server, in a registry of its own (never the global one, so
several apps in one process do not collide).

Engine-side values (queues, KV usage, prefix cache, preemptions) are read from the engine
client's latest stats at scrape time by a custom collector; request-side values
(latencies, token counts, finished requests) are observed by the server as it answers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineStatsCollector(Collector):
    """`pd_engine_alive`, and while the engine lives its latest stats (`EngineStats`,
    or None before the first step). A dead engine's last figures are not shown: they
    would describe requests and blocks that no longer exist."""

    def __init__(self, get_stats: Callable[[], Any], is_alive: Callable[[], bool],
                 get_restarts: Callable[[], int] = lambda: 0) -> None:
        self.get_stats = get_stats
        self.is_alive = is_alive
        self.get_restarts = get_restarts

    def collect(self) -> Iterator[Metric]:
        alive = GaugeMetricFamily("pd_engine_alive", "1 while the engine core process serves, 0 once it died.")
        alive.add_metric([], int(self.is_alive()))
        yield alive
        restarts = CounterMetricFamily("pd_engine_restarts", "Engine core processes started in place of one "
                                       "that died (--restart-engine).")
        restarts.add_metric([], self.get_restarts())
        yield restarts
        if self.is_alive():
            yield from self._engine_metrics(self.get_stats())

    def _engine_metrics(self, stats: Any) -> Iterator[Metric]:
        running = GaugeMetricFamily("pd_num_requests_running", "Requests in the engine's running batch.")
        waiting = GaugeMetricFamily("pd_num_requests_waiting", "Requests waiting to be scheduled.")
        usage = GaugeMetricFamily("pd_kv_cache_usage", "Fraction of KV cache blocks in use (0..1).")
        preemptions = CounterMetricFamily("pd_num_preemptions", "Requests preempted for lack of KV blocks.")
        queries = CounterMetricFamily("pd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache; "
                                      "unlabelled: overall, `group`: per KV cache group.", labels=["group"])
        hits = CounterMetricFamily("pd_prefix_cache_hits", "Prompt tokens found in the prefix cache; "
                                   "unlabelled: overall, `group`: per KV cache group.", labels=["group"])
        if stats is not None:
            running.add_metric([], stats.num_running)
            waiting.add_metric([], stats.num_waiting)
            usage.add_metric([], stats.kv_usage)
            preemptions.add_metric([], stats.num_preemptions)
            queries.add_metric([], stats.prefix_cache_queries)
            hits.add_metric([], stats.prefix_cache_hits)
            for name, q, h in zip(stats.group_names, stats.group_queries, stats.group_hits):
                queries.add_metric([name], q)
                hits.add_metric([name], h)
        else:  # no step yet: an idle engine
            for family in (running, waiting, usage, preemptions, queries, hits):
                family.add_metric([], 0)
        yield from (running, waiting, usage, preemptions, queries, hits)
        yield kv_cache_bytes_metric(stats.kv_cache_bytes if stats is not None else [])
        yield prompt_source_metric(stats.prompt_tokens_by_source if stats is not None else {},
                                   tuple(stats.kv_offload) if stats is not None else ())
        yield from listener_metrics(stats)
        yield from step_metrics(stats)
        if stats is not None and stats.kv_transfer:  # a connector is configured
            yield from kv_transfer_metrics(stats.kv_transfer, stats.kv_transfer_path)
            yield from kv_transfer_histograms(stats.kv_transfer_histograms)
            yield from kv_transfer_rank_metrics(stats.kv_transfer_by_rank)
        if stats is not None and (stats.kv_transfer or stats.kv_offload):  # KV may be loaded from elsewhere
            yield from kv_load_failure_metrics(stats.kv_load_failures)
        if stats is not None and stats.kv_transfer:
            skipped = CounterMetricFamily("pd_kv_prefix_reads_skipped", "Prefixes a decode server exported for "
                                          "this server to read that it held already: nothing was read (not a failure).")
            skipped.add_metric([], stats.kv_prefix_reads_skipped)
            yield skipped
        if stats is not None and stats.kv_offload:  # offload tiers are configured
            yield from kv_offload_metrics(stats.kv_offload, stats.kv_offload_load_seconds)


# metric name (without pd_kv_transfer_ and _total) -> (connector stats field, help)
KV_TRANSFER_COUNTERS = {
    "reads": ("reads", "KV reads completed (decode side)."),
    "bytes": ("read_bytes", "Bytes of KV read from prefill servers (by every tensor-parallel rank)."),
    "seconds": ("read_seconds", "Seconds KV reads took, from post to completion."),
    "descriptors": ("read_descriptors", "Transfer descriptors of completed reads (one per run of blocks per group; "
                                        "per block per prefill rank between tensor-parallel sizes)."),
    "failures": ("failures", "KV reads that failed or ended after the prefill server's lease."),
    "leases_expired": ("leases_expired", "Requests whose KV blocks a prefill server freed unread after the lease."),
    "rejects": ("rejects_received", "Requests a decode server rejected (their blocks freed at once)."),
    "released": ("released", "Requests whose kept blocks were released because their decode request failed."),
    "keep_alives": ("keep_alives_received", "Lease extensions asked by decode servers whose queue holds the request."),
    "failed_notifications": ("failed_notifications",
                             "Notifications (reject, keep-alive) that could not reach a prefill server."),
    "handshakes": ("handshakes", "Side-channel handshakes with prefill servers that succeeded."),
    "digests_checked": ("digests_checked",
                        "KV reads whose every byte matched the holder's digests (--kv-digest on the holder)."),
    "digest_mismatches": ("digest_mismatches", "KV reads whose bytes differed from the holder's digests: load "
                                               "failures (recomputed or failed by --kv-load-failure-policy)."),
    "handshake_failures": ("handshake_failures", "Side-channel handshakes with prefill servers that failed."),
    "handshakes_refused": ("handshakes_refused", "Side-channel handshakes this server refused: not from an allowed "
                                                 "peer (--kv-allowed-peers), or no proof of the transfer secret."),
    "stranger_notifications": ("stranger_notifications", "NIXL notifications ignored: from an agent this server's "
                                                         "side channel never answered."),
}


def kv_transfer_metrics(values: dict[str, float], path: str = "") -> Iterator[Metric]:
    """pd_kv_transfer_*_total counters, pd_kv_transfer_bytes_by_path_total{path} (the
    bytes read, labelled with what they crossed) and pd_kv_requests_held."""
    for name, (field, help_text) in KV_TRANSFER_COUNTERS.items():
        family = CounterMetricFamily(f"pd_kv_transfer_{name}", help_text)
        family.add_metric([], values.get(field, 0.0))
        yield family
    by_path = CounterMetricFamily("pd_kv_transfer_bytes_by_path", "Bytes of KV read, by what they crossed as UCX is "
                                  "configured: cma (one host, shared memory), tcp or rdma (between hosts), ucx (an "
                                  "operator's own transports).", labels=["path"])
    if path:
        by_path.add_metric([path], values.get("read_bytes", 0.0))
    yield by_path
    held = GaugeMetricFamily("pd_kv_requests_held", "Requests whose KV blocks a prefill server keeps for a reader.")
    held.add_metric([], values.get("requests_held", 0.0))
    yield held


def kv_cache_bytes_metric(values: list[int]) -> Metric:
    """pd_kv_cache_bytes{rank}: each tensor-parallel rank's KV cache memory. Every rank
    holds the same blocks (its heads of them), so pd_kv_cache_usage is each rank's too."""
    family = GaugeMetricFamily("pd_kv_cache_bytes", "KV cache memory of each tensor-parallel rank (its heads of "
                               "every block; pd_kv_cache_usage applies to each).", labels=["rank"])
    for rank, value in enumerate(values):
        family.add_metric([str(rank)], value)
    return family


# figure in the connector's by-rank stats -> (metric name, help)
KV_TRANSFER_RANK_COUNTERS = {
    "bytes": ("pd_kv_transfer_rank_bytes", "Bytes of KV each tensor-parallel rank of this decode server read."),
    "descriptors": ("pd_kv_transfer_rank_descriptors", "Transfer descriptors of each tensor-parallel rank's reads."),
}


def kv_transfer_rank_metrics(values: dict[str, dict[int, int]]) -> Iterator[Metric]:
    """pd_kv_transfer_rank_*_total{rank}: the transfer counters per decode rank (their
    sums are pd_kv_transfer_bytes_total and _descriptors_total)."""
    for key, (name, help_text) in KV_TRANSFER_RANK_COUNTERS.items():
        family = CounterMetricFamily(name, help_text, labels=["rank"])
        for rank, value in sorted(values.get(key, {}).items()):
            family.add_metric([str(rank)], value)
        yield family


# histogram name in the connector's stats -> (metric name, help)
KV_TRANSFER_HISTOGRAMS = {
    "xfer_time": ("pd_kv_transfer_xfer_time_seconds", "Seconds a KV read took, from post to completion."),
    "post_time": ("pd_kv_transfer_post_time_seconds", "Seconds posting a KV read took."),
    "bytes_per_read": ("pd_kv_transfer_bytes_per_read", "Bytes moved by one KV read (with tensor parallelism: one "
                                                        "decode rank's share of a request)."),
    "descriptors_per_read": ("pd_kv_transfer_descriptors_per_read",
                             "Transfer descriptors of one KV read (with tensor parallelism: one decode rank's share "
                             "of a request)."),
    "handshake_time": ("pd_kv_transfer_handshake_time_seconds", "Seconds a side-channel handshake took."),
}


def kv_transfer_histograms(histograms: dict[str, Any]) -> Iterator[Metric]:
    for key, (name, help_text) in KV_TRANSFER_HISTOGRAMS.items():
        family = HistogramMetricFamily(name, help_text)
        h = histograms.get(key)
        if h is not None:
            family.add_metric([], _buckets(h), sum_value=h.total)
        yield family


def _buckets(h: Any) -> list[tuple[str, float]]:
    """A histogram snapshot's cumulative buckets, as Prometheus writes them (+Inf last)."""
    cumulative = list(itertools.accumulate(h.counts))
    return [(repr(float(le)), float(c)) for le, c in zip(h.buckets, cumulative)] + [("+Inf", float(cumulative[-1]))]


def step_metrics(stats: Any) -> Iterator[Metric]:
    """pd_engine_steps_total, and pd_engine_step_seconds_total{part}: where the engine
    process's busy time went (schedule, execute: inputs + model + sampling, update, ipc:
    its messaging with this server). Set against the server's inter-token latency, they
    say how much of it is the step and how much is outside it."""
    steps = CounterMetricFamily("pd_engine_steps", "Engine steps run.")
    seconds = CounterMetricFamily("pd_engine_step_seconds", "Engine process busy time by part: schedule, execute "
                                  "(inputs, model, sampling), update, ipc (messages to and from the server).",
                                  labels=["part"])
    steps.add_metric([], stats.num_steps if stats is not None else 0)
    for part, value in (stats.step_seconds if stats is not None else {}).items():
        seconds.add_metric([part], value)
    yield steps
    yield seconds


def prompt_source_metric(values: dict[str, int], tiers: tuple[str, ...] = ()) -> Metric:
    """pd_prompt_tokens_by_source_total{source}: prompt tokens of requests that ran, by
    where their KV came from (computed here, the local prefix cache, a remote prefill)."""
    family = CounterMetricFamily("pd_prompt_tokens_by_source", "Prompt tokens of requests that ran, by where "
                                 "their KV came from: computed, local_cache, remote, or an offload tier (host, disk).",
                                 labels=["source"])
    base = ("computed", "local_cache", "remote", *tiers)
    for source in (*base, *sorted(set(values) - set(base))):
        family.add_metric([source], values.get(source, 0))
    return family


# pd_kv_offload_<name>_total{tier} -> help; the figures of pd/kv_offload/connector.py
KV_OFFLOAD_COUNTERS = {
    "stored_blocks": "Blocks written to the tier.",
    "stored_bytes": "Bytes written to the tier.",
    "loaded_blocks": "Blocks loaded back from the tier into the KV cache.",
    "loaded_bytes": "Bytes loaded back from the tier.",
    "store_failures": "Blocks whose write failed.",
    "load_failures": "Loads that failed (the request computed those tokens instead).",
    "corrupt_blocks": "Blocks that failed their checksum when loaded (dropped).",
}
KV_OFFLOAD_GAUGES = {
    "blocks": "Blocks the tier holds.",
    "usage": "Fraction of the tier's slots holding or being written (0..1).",
    "capacity_bytes": "Bytes the tier may hold.",
    "on": "1 while the tier serves, 0 once it turned itself off (see the server's log).",
}


def kv_offload_metrics(tiers: dict[str, dict[str, float]], load_seconds: dict[str, Any]) -> Iterator[Metric]:
    """pd_kv_offload_*{tier}: what each offload tier stored, loaded and holds, and how long
    its loads took (its hits are pd_prompt_tokens_by_source_total{source=<tier>})."""
    for name, help_text in KV_OFFLOAD_COUNTERS.items():
        family = CounterMetricFamily(f"pd_kv_offload_{name}", help_text, labels=["tier"])
        for tier, values in tiers.items():
            family.add_metric([tier], values.get(name, 0.0))
        yield family
    for name, help_text in KV_OFFLOAD_GAUGES.items():
        family = GaugeMetricFamily(f"pd_kv_offload_{name}", help_text, labels=["tier"])
        for tier, values in tiers.items():
            family.add_metric([tier], values.get(name, 0.0))
        yield family
    family = HistogramMetricFamily("pd_kv_offload_load_seconds", "Seconds a load from the tier took, from post "
                                   "to its end (its checksums verified).", labels=["tier"])
    for tier, h in load_seconds.items():
        family.add_metric([tier], _buckets(h), sum_value=h.total)
    yield family


# where the engine receives messages from outside its server: its IPC input, the KV events
# replay socket, the KV side channel, NIXL notifications
LISTENERS = ("engine_input", "kv_events_replay", "side_channel", "nixl_notification")


def listener_metrics(stats: Any) -> Iterator[Metric]:
    """pd_malformed_messages_total{listener}: messages the engine dropped as malformed, by
    where they came in; pd_kv_events_replies_dropped_total: replay replies not queued
    for clients that do not read theirs (or past the number of clients answered)."""
    malformed = CounterMetricFamily("pd_malformed_messages", "Messages the engine dropped as malformed, by the "
                                    "listener that received them.", labels=["listener"])
    counts = stats.malformed_messages if stats is not None else {}
    for listener in LISTENERS:
        malformed.add_metric([listener], counts.get(listener, 0))
    dropped = CounterMetricFamily("pd_kv_events_replies_dropped", "KV events replay replies dropped: the client "
                                  "did not read earlier ones, or too many clients asked.")
    dropped.add_metric([], stats.kv_events_replies_dropped if stats is not None else 0)
    yield malformed
    yield dropped


def kv_load_failure_metrics(values: dict[str, int]) -> Iterator[Metric]:
    """pd_kv_load_failures_total{policy}: requests whose KV could not be loaded (from a
    prefill server, or an offload tier), by what was done (recompute / fail)."""
    family = CounterMetricFamily("pd_kv_load_failures", "Requests whose KV could not be loaded from another "
                                 "server or an offload tier, by what was done: recompute or fail (a tier's "
                                 "failed loads are always recomputed).", labels=["policy"])
    for policy in ("recompute", "fail"):
        family.add_metric([policy], values.get(policy, 0))
    yield family


class ServerMetrics:
    """Every metric of one server; `render()` is the /metrics body."""

    def __init__(self, get_stats: Callable[[], Any], is_alive: Callable[[], bool] = lambda: True,
                 get_restarts: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(get_stats, is_alive, get_restarts))
        r = self.registry
        self.time_to_first_token = Histogram("pd_time_to_first_token_seconds",
                                             "Seconds from arrival to the first output token.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("pd_inter_token_latency_seconds",
                                             "Seconds between consecutive output tokens of a request.",
                                             buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("pd_e2e_request_latency_seconds",
                                             "Seconds from arrival to the last output of a request.",
                                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pd_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("pd_generation_tokens", "Output tokens generated.", registry=r)
        self.request_success = Counter("pd_request_success", "Requests finished, by finish reason.",
                                       ["finish_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
