"""The servers behind the proxy and how one is picked for a request.

An `Instance` is one `pd serve` (a prefill or a decode server): its URL, whether it is
healthy, and how many requests the proxy has outstanding on it. A failed request marks
its instance unhealthy; `InstancePool.probe` (run periodically by the app) asks each
instance's /health and brings it back when it answers.

Policies pick among the healthy instances not excluded for this request:

- `round_robin`: in turn.
- `least_loaded`: fewest outstanding requests (ties in turn).
- `prefix_aware`: a consistent-hash ring over the request's prefix key (the first
  blocks of its prompt), so requests sharing a prefix land on the same instance and keep
  its prefix-cache hits; when that instance is saturated (more than `SATURATION_SLACK`
  requests above the least loaded), the least loaded one instead.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

POLICIES = ("round_robin", "least_loaded", "prefix_aware")
VIRTUAL_NODES = 64  # points per instance on the hash ring
SATURATION_SLACK = 4  # prefix_aware leaves its instance when it has this many more requests than the least loaded


class NoInstanceError(Exception):
    """No healthy instance is left for this request."""


@dataclass
class Instance:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    outstanding: int = 0
    requests: int = 0  # sent to it since start
    failures: int = 0
    last_error: str | None = None

    def mark_failed(self, error: str) -> None:
        self.healthy = False
        self.failures += 1
        self.last_error = error

    def state(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "outstanding": self.outstanding,
                "requests": self.requests, "failures": self.failures, "last_error": self.last_error}


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class InstancePool:
    """The instances of one role and the policy that picks among them."""

    instances: list[Instance]
    policy: str = "round_robin"
    _turn: itertools.count = field(default_factory=itertools.count, repr=False)
    _ring: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (point, instance index)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.instances:
            raise ValueError("an instance pool needs at least one instance")
        self._ring = sorted((_point(f"{inst.url}#{v}"), i) for i, inst in enumerate(self.instances)
                            for v in range(VIRTUAL_NODES))

    @classmethod
    def of(cls, urls: Sequence[str], role: str, policy: str) -> InstancePool:
        return cls([Instance(url.rstrip("/"), role) for url in urls], policy)

    def pick(self, prefix_key: str, exclude: set[str] = frozenset()) -> Instance:
        """An instance for a request; NoInstanceError if every one is unhealthy or excluded."""
        candidates = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not candidates:
            raise NoInstanceError(f"no healthy {self.instances[0].role} instance left")
        least = min(i.outstanding for i in candidates)
        if self.policy == "prefix_aware":
            chosen = self._on_ring(prefix_key, candidates)
            if chosen.outstanding <= least + SATURATION_SLACK:
                return chosen
        if self.policy in ("least_loaded", "prefix_aware"):
            candidates = [i for i in candidates if i.outstanding == least]
        return candidates[next(self._turn) % len(candidates)]

    def _on_ring(self, key: str, candidates: list[Instance]) -> Instance:
        allowed = {id(i) for i in candidates}
        start = bisect.bisect(self._ring, (_point(key), -1))
        for k in range(len(self._ring)):
            instance = self.instances[self._ring[(start + k) % len(self._ring)][1]]
            if id(instance) in allowed:
                return instance
        raise AssertionError("candidates are never empty here")

    async def probe(self, client: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
        """Ask every instance's /health; healthy again when it answers 200."""
        for instance in self.instances:
            try:
                response = await client.get(f"{instance.url}/health", timeout=timeout_s)
                ok = response.status_code == 200
                error = None if ok else f"/health answered {response.status_code}"
            except httpx.HTTPError as exc:
                ok, error = False, f"/health failed: {type(exc).__name__}: {exc}"
            if ok:
                instance.healthy = True
            elif instance.healthy:
                instance.mark_failed(error)
            else:
                instance.last_error = error
