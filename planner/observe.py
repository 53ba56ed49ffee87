"""What the planner sees each tick: the proxy's fleet (`GET /admin/instances`) and what
each server's /metrics says, turned into a `Load` and the servers' `Costs`.

From the differences between two ticks, summed over the servers of a role:
- load: requests arriving per second (the proxy counts them), prompt tokens computed per
  prefilled request, output tokens per decoded request (each a ratio of two means over
  the ticks, tokens over requests: a long prompt's chunks fall in several ticks, so one
  tick's or one server's own ratio says little); now: the prompt tokens queued on prefill
  servers (the proxy's count) and those waiting in its queue, and the sequences being
  decoded;
- costs: a prefill server's prompt tokens per busy second; a decode step's time against
  its batch (sequences per step), fitted `a + k x batch` over the last ticks once the
  batches seen spread over `SPREAD` sequences, else with `k` as given; the KV read's mean
  time. Every figure is an exponentially weighted mean (`ALPHA`), and the given priors
  stand until something was measured. The servers are taken to be alike.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from planner.model import Costs, Load
from planner.policy import Member
from wire.fleet import ADMIN_PATH

ALPHA = 0.5  # weight of the newest figure
FIT_SAMPLES = 30  # decode steps' (batch, seconds) kept for the fit
SPREAD = 2.0  # batches seen must spread over this many sequences before `k` is fitted
MIN_TOKENS, MIN_STEPS = 32, 4  # a tick with fewer says nothing about a server's speed
SHIFT_TICKS, SHIFT_FACTOR = 5, 2.0  # a load window restarts where the rate doubled or halved for this many ticks
COUNTED = ("computed", "busy_s", "steps", "generated", "finished", "xfer_s", "xfers")  # Counters' counters, in order


@dataclass
class Counters:
    at: float
    computed: float = 0.0  # prompt tokens computed here
    busy_s: float = 0.0  # engine busy seconds
    steps: float = 0.0
    generated: float = 0.0
    finished: float = 0.0  # requests finished
    xfer_s: float = 0.0  # KV reads: seconds, and how many
    xfers: float = 0.0
    running: float = 0.0

    def add(self, other: Counters) -> None:
        for f in (*COUNTED, "running"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def minus(self, before: Counters) -> Counters:
        return Counters(self.at - before.at, *(getattr(self, f) - getattr(before, f) for f in COUNTED), self.running)


# a server's sample -> the Counters field it adds to (those with a label: that label's value only)
SAMPLES = {"pd_prompt_tokens_by_source_total": ("computed", ("source", "computed")),
           "pd_engine_step_seconds_total": ("busy_s", None), "pd_engine_steps_total": ("steps", None),
           "pd_generation_tokens_total": ("generated", None), "pd_request_success_total": ("finished", None),
           "pd_kv_transfer_xfer_time_seconds_sum": ("xfer_s", None),
           "pd_kv_transfer_xfer_time_seconds_count": ("xfers", None), "pd_num_requests_running": ("running", None)}


def server_counters(text: str, at: float) -> Counters:
    c = Counters(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, only = SAMPLES.get(sample.name, (None, None))
            if name is not None and (only is None or sample.labels.get(only[0]) == only[1]):
                setattr(c, name, getattr(c, name) + sample.value)
    return c


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else ALPHA * new + (1 - ALPHA) * old


@dataclass
class Observer:
    proxy_url: str
    admin_key: str
    priors: Costs
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5))
    clock: Callable[[], float] = time.monotonic  # the simulator's (benchmarks/sim) runs on its own
    load_window_s: float = 0.0  # the arrival rate is the mean over this long (0: since the last tick)
    _servers: dict[str, Counters] = field(default_factory=dict)
    _arrivals: deque = field(default_factory=deque)  # (at, requests that had arrived at the proxy), oldest first
    _estimates: dict[str, float] = field(default_factory=dict)
    _parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # a ratio's means: (amount, count)
    _steps: deque = field(default_factory=lambda: deque(maxlen=FIT_SAMPLES))

    def observe(self) -> tuple[list[Member], Load, Costs]:
        fleet = self._admin(ADMIN_PATH)
        members = [Member(i["url"], i["role"], tuple(i["roles"]), i["outstanding"] + i["bound"],
                          i["draining"] or i["leaving"]) for i in fleet["instances"]]
        queued = sum(i["outstanding_tokens"] for i in fleet["instances"] if i["role"] == "prefill")
        now = self.clock()
        self._observe_proxy(fleet, now)
        sums = {"prefill": Counters(now), "decode": Counters(now)}
        for instance in fleet["instances"]:
            delta = self._observe_server(instance["url"], now)
            if delta is not None and instance["role"] in sums:
                sums[instance["role"]].add(delta)
                if instance["role"] == "decode" and delta.steps >= MIN_STEPS:
                    self._steps.append((delta.generated / delta.steps, delta.busy_s / delta.steps))
        self._learn(sums["prefill"], sums["decode"])
        est = self._estimates
        prompt = est.get("prompt_tokens", 0.0)
        load = Load(est.get("arrival_rate", 0.0), prompt, est.get("output_tokens", 0.0),
                    queued + fleet.get("queue_waiting", 0) * prompt, sums["decode"].running)
        return members, load, self.costs()

    def costs(self) -> Costs:
        costs = replace(self.priors, **{k: self._estimates[k] for k in ("prefill_tokens_per_s", "transfer_s")
                                        if k in self._estimates})
        if self._steps:
            batches, seconds = zip(*self._steps)
            k = costs.decode_step_per_seq_s
            if max(batches) - min(batches) >= SPREAD:
                mb, ms = sum(batches) / len(batches), sum(seconds) / len(seconds)
                var = sum((b - mb) ** 2 for b in batches)
                k = max(0.0, sum((b - mb) * (s - ms) for b, s in zip(batches, seconds)) / var)
            a = sum(s - k * b for b, s in self._steps) / len(self._steps)
            costs = replace(costs, decode_step_s=max(a, 1e-4), decode_step_per_seq_s=k)
        return costs

    def _admin(self, path: str) -> dict:
        response = self.client.get(self.proxy_url + path, headers={"Authorization": f"Bearer {self.admin_key}"})
        response.raise_for_status()
        return response.json()

    def _observe_proxy(self, fleet: dict, now: float) -> None:
        """The arrival rate: over the last tick, as an exponentially weighted mean; or with
        a load window, the mean over the window (the ticks spanning it), so that a split
        does not chase each swing of a bursty load. A rate that has doubled or halved over
        the last SHIFT_TICKS ticks against the window's earlier ones is a new level, not a
        swing: the window restarts there (waiting out a whole window for it left a fleet
        with a phase's old split for its first 20 s, and a backlog it did not make up)."""
        arrivals, seen = fleet["arrivals"], self._arrivals
        if seen and now <= seen[-1][0]:
            return
        seen.append((now, arrivals))
        if self.load_window_s <= 0:
            if len(seen) > 1:
                at, before = seen.popleft()
                rate = max(0.0, arrivals - before) / (now - at)
                self._estimates["arrival_rate"] = _ewma(self._estimates.get("arrival_rate"), rate)
            return
        while len(seen) > 2 and now - seen[1][0] >= self.load_window_s:
            seen.popleft()
        if len(seen) > SHIFT_TICKS + 1:
            (first, n0), (cut, n1) = seen[0], seen[-1 - SHIFT_TICKS]
            older, recent = (n1 - n0) / (cut - first), (arrivals - n1) / (now - cut)
            if older > 0 and not older / SHIFT_FACTOR <= recent <= older * SHIFT_FACTOR:
                while len(seen) > SHIFT_TICKS + 1:
                    seen.popleft()
        if len(seen) > 1:
            at, before = seen[0]
            self._estimates["arrival_rate"] = max(0.0, arrivals - before) / (now - at)

    def _metrics(self, url: str) -> str:
        response = self.client.get(f"{url}/metrics")
        response.raise_for_status()
        return response.text

    def _observe_server(self, url: str, now: float) -> Counters | None:
        try:
            counters = server_counters(self._metrics(url), now)
        except (httpx.HTTPError, ValueError):
            return None
        before, self._servers[url] = self._servers.get(url), counters
        return None if before is None else counters.minus(before)

    def _learn(self, prefill: Counters, decode: Counters) -> None:
        """The estimates from one tick's differences, summed over each role's servers."""
        est = self._estimates
        if prefill.computed >= MIN_TOKENS and prefill.busy_s > 0:
            est["prefill_tokens_per_s"] = _ewma(est.get("prefill_tokens_per_s"), prefill.computed / prefill.busy_s)
        self._ratio("prompt_tokens", prefill.computed, prefill.finished)
        self._ratio("output_tokens", decode.generated, decode.finished)
        self._ratio("transfer_s", decode.xfer_s, decode.xfers)

    def _ratio(self, name: str, amount: float, count: float) -> None:
        """`name` = the mean of `amount` per tick over the mean of `count` per tick; a tick
        with neither leaves it as it was."""
        if amount <= 0 and count <= 0:
            return
        old_amount, old_count = self._parts.get(name, (None, None))
        mean_amount, mean_count = _ewma(old_amount, amount), _ewma(old_count, count)
        self._parts[name] = (mean_amount, mean_count)
        if mean_count > 0:
            self._estimates[name] = mean_amount / mean_count
