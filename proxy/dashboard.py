"""The operator's live page: `GET /dashboard`, one HTML file with its script inline
(`static/dashboard.html`, no build step), and `GET /dashboard/state`, the JSON the page
polls every second.

The state holds, per instance, what the proxy knows itself (role, health, breaker,
requests in flight, the blocks its KV events say it holds) and what the server's own
/metrics says: KV cache usage, prefix-cache hit rate since it started, and the rate at
which it reads KV from other servers (bytes/s between two samples). /metrics is asked
only when the state is (at most once per `SAMPLE_MIN_INTERVAL_S`, of instances whose
breaker lets requests through, within `SAMPLE_TIMEOUT_S`; an answer never counts
against a breaker); a figure not known is null. Then the last requests (`recent.py`).

Both routes need the API key, like every route but /health. A browser's navigation
cannot send a header, so /dashboard also takes it as `?key=KEY`; the page sends it on
its fetches as `Authorization: Bearer`. No query reaches the access log (`RedactKey`):
the check decodes the query (`?%6Bey=KEY` is `key=KEY`), so no pattern of the raw text
could tell every spelling of the key apart from other parameters.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import time
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import httpx
from fastapi.responses import HTMLResponse

from proxy.instances import Instance
from proxy.recent import RecentRequests
from proxy.upstream import Upstream

SAMPLE_MIN_INTERVAL_S = 0.5
SHOWN_CHANGES = 20  # the latest fleet changes on the page
SAMPLE_TIMEOUT_S = 1.0
KV_USAGE, HIT_QUERIES, HITS = "pd_kv_cache_usage", "pd_prefix_cache_queries_total", "pd_prefix_cache_hits_total"
TRANSFER_BYTES = "pd_kv_transfer_bytes_total"
# a path's query, and parameters after a ';' (which uvicorn's log writes percent-escaped)
_QUERY = re.compile(r"(?:[?;]|%3[bB]).*", re.DOTALL)


@dataclass(frozen=True)
class Sample:
    """What one server's /metrics said at `at` (monotonic s); None where it said nothing."""

    at: float
    kv_usage: float | None = None
    hit_rate: float | None = None
    transfer_bytes: float | None = None
    transfer_rate: float | None = None  # bytes/s since the sample before


def parse_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, keyed by its name and labels as written."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                samples[key] = float(value)
            except ValueError:
                continue
    return samples


def sample(samples: dict[str, float] | None, at: float, before: Sample | None) -> Sample:
    if samples is None:
        return Sample(at)
    queries, hits = samples.get(HIT_QUERIES), samples.get(HITS)
    moved = samples.get(TRANSFER_BYTES)
    rate = None
    if moved is not None and before is not None and before.transfer_bytes is not None and at > before.at:
        rate = max(0.0, moved - before.transfer_bytes) / (at - before.at)
    return Sample(at, samples.get(KV_USAGE), hits / queries if queries and hits is not None else None, moved, rate)


class Dashboard:
    """The state /dashboard/state answers, and the record of the last requests."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.recent = RecentRequests()
        self._samples: dict[str, Sample] = {}
        self._sampled_at = float("-inf")

    @property
    def instances(self) -> list[Instance]:
        return self.upstream.prefill.instances + self.upstream.decode.instances

    async def state(self) -> dict[str, Any]:
        await self._refresh()
        config = self.upstream.config
        return {"prefill_policy": config.role_policy("prefill"), "decode_policy": config.role_policy("decode"),
                "disagg_policy": config.disagg_policy, "queue_waiting": self.upstream.admission.num_waiting,
                "instances": [self._instance(i) for i in self.instances], "requests": self.recent.newest_first(),
                "fleet_changes": [c.state() for c in reversed(self.upstream.fleet.changes)][:SHOWN_CHANGES],
                "planner_decisions": self.upstream.fleet.recent_decisions(SHOWN_CHANGES, inputs=False)}

    def _instance(self, instance: Instance) -> dict[str, Any]:
        figures = self._samples.get(instance.url) if instance.healthy else None
        return {"url": instance.url, "role": instance.role, "source": instance.source, "draining": instance.draining,
                "leaving": instance.url in self.upstream.fleet.leaving, "healthy": instance.healthy,
                "breaker": instance.breaker.state, "in_flight": instance.in_flight, "requests": instance.requests,
                "failures": instance.failures, "last_error": instance.last_error,
                "kv_blocks": None if instance.kv_index is None else len(instance.kv_index.blocks),
                "kv_usage": figures and figures.kv_usage, "hit_rate": figures and figures.hit_rate,
                "transfer_rate": figures and figures.transfer_rate}

    async def _refresh(self) -> None:
        """Ask each instance's /metrics, unless that was done less than
        SAMPLE_MIN_INTERVAL_S ago (several pages open ask no more often than one)."""
        now = time.monotonic()
        if now - self._sampled_at < SAMPLE_MIN_INTERVAL_S:
            return
        self._sampled_at = now
        instances = [i for i in self.instances if i.healthy]
        scraped = await asyncio.gather(*(self._scrape(i.url) for i in instances))
        for instance, samples in zip(instances, scraped):
            self._samples[instance.url] = sample(samples, now, self._samples.get(instance.url))
        members = {i.url for i in self.instances}
        for gone in [url for url in self._samples if url not in members]:  # it left the fleet
            del self._samples[gone]

    async def _scrape(self, url: str) -> dict[str, float] | None:
        authorization = self.upstream.config.server_authorization
        try:
            response = await self.upstream.client.get(f"{url}/metrics", timeout=SAMPLE_TIMEOUT_S,
                                                      headers={"Authorization": authorization} if authorization else {})
        except httpx.HTTPError:
            return None
        return parse_samples(response.text) if response.status_code == 200 else None


def _page() -> tuple[bytes, str]:
    """The page, and the CSP source of its one inline script (its hash: no other runs)."""
    html = files("proxy").joinpath("static/dashboard.html").read_bytes()
    script = html.split(b"<script>", 1)[1].split(b"</script>", 1)[0]
    return html, f"'sha256-{base64.b64encode(hashlib.sha256(script).digest()).decode()}'"


PAGE, SCRIPT_SOURCE = _page()
PAGE_HEADERS = {"Content-Security-Policy": f"default-src 'none'; script-src {SCRIPT_SOURCE}; "
                                           "style-src 'unsafe-inline'; connect-src 'self'; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def page_response() -> HTMLResponse:
    return HTMLResponse(PAGE, headers=PAGE_HEADERS)


class RedactKey(logging.Filter):
    """Replaces the query (and `;` parameters) of the path in an access log record
    (uvicorn's arguments: client, method, path with query, HTTP version, status) with
    `?***`, whatever it holds."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) >= 3 and isinstance(record.args[2], str):
            args = list(record.args)
            args[2] = _QUERY.sub("?***", args[2])
            record.args = tuple(args)
        return True
