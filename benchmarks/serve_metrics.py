"""The serving benchmark's arithmetic: per-request records, arrival times, aggregate
metrics (as vLLM's benchmark_serving defines them) and Prometheus counter deltas.
Pure functions, no I/O: `serve.py` does the HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
PREFIX_QUERIES = "pd_prefix_cache_queries_total"
PREFIX_HITS = "pd_prefix_cache_hits_total"
KV_TRANSFER_BYTES = "pd_kv_transfer_bytes_total"
PROMPT_SOURCES = "pd_prompt_tokens_by_source_total"
TIER_SOURCES = ("disk",)  # prompt tokens loaded back from an offload tier: hits too


@dataclass
class RequestRecord:
    """One request's timeline, in seconds since the benchmark started."""

    prompt_len: int
    start: float = 0.0
    end: float = 0.0
    success: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_len: int = 0
    output_len_from_usage: bool = False
    error: str | None = None
    turn: int = 0  # multi-turn: which turn of its conversation (0: the first)
    token_ids: list[int] = field(default_factory=list)  # the answer's, where the server returned them

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if not self.success or self.output_len <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


# ---------------------------------------------------------------- arrivals


def arrival_intervals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request arrivals: gamma(shape=burstiness, mean=1/rate); zeros at rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    theta = 1.0 / (rate * burstiness)
    return np.random.default_rng(seed).gamma(burstiness, theta, size=n).tolist()


def send_offsets(intervals: Sequence[float]) -> list[float]:
    """Send times: the first request at 0, each next one an interval after the previous."""
    return [0.0] + np.cumsum(intervals[:-1]).tolist() if intervals else []


# ---------------------------------------------------------------- metrics


def summarize_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / median / std / p99 of seconds, in milliseconds; None when there are none."""
    if not values_s:
        return {"mean": None, "median": None, "std": None, "p99": None}
    ms = np.asarray(values_s, dtype=float) * 1000
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "std": float(ms.std()), "p99": float(np.percentile(ms, 99))}


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at one instant; one ending as another starts do not overlap."""
    events = sorted([(r.end, -1) for r in records] + [(r.start, 1) for r in records])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return peak


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    measured_s = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(measured_s[name] * 1000 <= limit for name, limit in slos_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    goodput_slos: dict[str, float] | None = None) -> dict:
    """Aggregate figures of a run that took `duration` seconds (SLOs in milliseconds)."""
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    metrics = {
        "duration_s": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "request_goodput": None, "peak_concurrency": peak_concurrency(records),
        "output_len_from_chunks": sum(not r.output_len_from_usage for r in ok),
    }
    if goodput_slos:
        metrics["request_goodput"] = sum(meets_slos(r, goodput_slos) for r in ok) / duration
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [gap for r in ok for gap in r.itl], "e2el": [r.e2el for r in ok],
              # a conversation's later turns: what its earlier turns left cached (None unless multi-turn)
              "ttft_later_turns": [r.ttft for r in ok if r.turn > 0]}
    for name, values in series.items():
        for stat, value in summarize_ms(values).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


# ---------------------------------------------------------------- Prometheus

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_prometheus(text: str) -> Samples:
    """Prometheus text format → {metric name: {sorted (label, value) pairs: sample value}}."""
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        match = None if line.startswith("#") else _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        pairs = tuple(sorted((key, re.sub(r"\\.", lambda m: _UNESCAPE.get(m[0], m[0]), raw))
                             for key, raw in _LABEL.findall(labels or "")))
        samples.setdefault(name, {})[pairs] = float(value)
    return samples


def counter_deltas(before: Samples, after: Samples, name: str) -> dict[tuple, float]:
    """Increase of each series of counter `name` (a series new in `after` started at 0)."""
    old = before.get(name, {})
    return {labels: value - old.get(labels, 0.0) for labels, value in after.get(name, {}).items()}


def _hit_rate(queries: float, hits: float) -> dict:
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


def server_metric_deltas(before: Samples, after: Samples) -> dict:
    """Prefix-cache hit rates (overall and per `group` label), prompt tokens loaded from an
    offload tier (None without one) and KV transfer bytes. The
    overall rate is the unlabelled series when the server exports one (pd serve does:
    tokens hit after the reduction across groups), else the sum over groups."""
    queries = counter_deltas(before, after, PREFIX_QUERIES)
    hits = counter_deltas(before, after, PREFIX_HITS)
    result: dict = {"prefix_cache": None, "kv_transfer_bytes": None, "tier_hits": None}
    sources = {dict(labels).get("source"): value for labels, value in counter_deltas(before, after,
                                                                                      PROMPT_SOURCES).items()}
    if any(source in sources for source in TIER_SOURCES):  # the server has an offload tier
        result["tier_hits"] = sum(sources.get(source, 0.0) for source in TIER_SOURCES)
    if queries:
        groups: dict[str, list[float]] = {}
        overall = [0.0, 0.0]  # series without a group label: the overall counts, when the server has them
        for labels, value in queries.items():
            group = dict(labels).get("group")
            totals = overall if group is None else groups.setdefault(group, [0.0, 0.0])
            totals[0] += value
            totals[1] += hits.get(labels, 0.0)
        if overall == [0.0, 0.0] and not any(dict(labels).get("group") is None for labels in queries):
            overall = [sum(q for q, _ in groups.values()), sum(h for _, h in groups.values())]
        result["prefix_cache"] = {**_hit_rate(*overall),
                                  "by_group": {g: _hit_rate(q, h) for g, (q, h) in sorted(groups.items())}}
    transfers = counter_deltas(before, after, KV_TRANSFER_BYTES)
    if transfers:
        result["kv_transfer_bytes"] = {"total": sum(transfers.values()), "by_labels": {
            ",".join(f"{k}={v}" for k, v in labels): value for labels, value in transfers.items()}}
    return result
