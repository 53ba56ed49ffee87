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
- `kv_aware`: by what each instance really holds (its KV events, `kv_index.py`): the
  instance with the best `overlap_weight x (prompt tokens it holds) - load`, where load
  is the prompt tokens it still has to work through for requests in flight (and, for a
  decode server, `decode_load_tokens` per request it decodes); ties go to the least
  loaded, and a request no instance holds any of to the least loaded.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from kv_events.hashing import extend_block_hashes
from proxy.kv_index import KVIndex

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
VIRTUAL_NODES = 64  # points per instance on the hash ring
SATURATION_SLACK = 4  # prefix_aware leaves its instance when it has this many more requests than the least loaded


class NoInstanceError(Exception):
    """No healthy instance is left for this request."""


@dataclass
class Route:
    """What a policy knows of a request: its prefix key and, for kv_aware, the token ids
    of its prompt and the salt its blocks are named with (kv_events/hashing.py)."""

    key: str
    tokens: list[int] | None = None
    salt: str | None = None
    _hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    def block_hashes(self, block_size: int) -> list[bytes]:
        if block_size not in self._hashes:
            extra = self.salt.encode() if self.salt else b""
            self._hashes[block_size] = extend_block_hashes([], self.tokens or [], block_size, extra)
        return self._hashes[block_size]


@dataclass
class Instance:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    outstanding: int = 0
    outstanding_tokens: int = 0  # prompt tokens to work through for requests in flight (kv_aware)
    requests: int = 0  # sent to it since start
    failures: int = 0
    last_error: str | None = None
    kv_index: KVIndex | None = None  # what its KV events say it holds (kv_aware)
    block_size: int = 0  # tokens per block of the indexed KV cache group
    engine_pid: int | None = None  # as its /health last said: another one means it restarted
    cache_epoch: int = 0  # counts the times what it held was forgotten (its events are followed anew)

    def mark_failed(self, error: str) -> None:
        self.healthy = False
        self.failures += 1
        self.last_error = error
        self.forget_cache()

    def forget_cache(self) -> None:
        """What it held is unknown now (it failed, or restarted)."""
        self.cache_epoch += 1
        if self.kv_index is not None:
            self.kv_index.clear()

    def overlap_tokens(self, route: Route) -> int:
        """Prompt tokens of the request whose KV the instance holds, as far as its
        events say (0 without them)."""
        if self.kv_index is None or route.tokens is None or not self.block_size:
            return 0
        return self.kv_index.overlap(route.block_hashes(self.block_size)) * self.block_size

    def state(self) -> dict:
        indexed = None if self.kv_index is None else {"blocks": len(self.kv_index.blocks),
                                                      "events_seq": self.kv_index.last_seq}
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "outstanding": self.outstanding,
                "requests": self.requests, "failures": self.failures, "last_error": self.last_error,
                "kv_index": indexed}


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class InstancePool:
    """The instances of one role and the policy that picks among them."""

    instances: list[Instance]
    policy: str = "round_robin"
    overlap_weight: float = 1.0  # kv_aware: what a prompt token held is worth against a token of load
    decode_load_tokens: int = 0  # kv_aware: the load one request being decoded counts for
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
    def of(cls, urls: Sequence[str], role: str, policy: str, **weights: float) -> InstancePool:
        return cls([Instance(url.rstrip("/"), role) for url in urls], policy, **weights)

    def pick(self, route: Route, exclude: set[str] = frozenset()) -> Instance:
        """An instance for a request; NoInstanceError if every one is unhealthy or excluded."""
        candidates = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not candidates:
            raise NoInstanceError(f"no healthy {self.instances[0].role} instance left")
        least = min(i.outstanding for i in candidates)
        if self.policy == "kv_aware":
            chosen = self._by_cache(route, candidates)
            if chosen:
                candidates = chosen
        if self.policy == "prefix_aware":
            chosen = self._on_ring(route.key, candidates)
            if chosen.outstanding <= least + SATURATION_SLACK:
                return chosen
        if self.policy in ("least_loaded", "prefix_aware", "kv_aware"):
            least = min(i.outstanding for i in candidates)
            candidates = [i for i in candidates if i.outstanding == least]
        return candidates[next(self._turn) % len(candidates)]

    def _by_cache(self, route: Route, candidates: list[Instance]) -> list[Instance]:
        """The best scored instances (ties kept); none when no instance holds any of the
        prompt (then load alone decides)."""
        overlaps = [i.overlap_tokens(route) for i in candidates]
        if not any(overlaps):
            return []
        scores = [self.overlap_weight * held - self.load_tokens(i) for i, held in zip(candidates, overlaps)]
        best = max(scores)
        return [i for i, score in zip(candidates, scores) if score == best]

    def load_tokens(self, instance: Instance) -> float:
        return instance.outstanding_tokens + self.decode_load_tokens * instance.outstanding

    def _on_ring(self, key: str, candidates: list[Instance]) -> Instance:
        allowed = {id(i) for i in candidates}
        start = bisect.bisect(self._ring, (_point(key), -1))
        for k in range(len(self._ring)):
            instance = self.instances[self._ring[(start + k) % len(self._ring)][1]]
            if id(instance) in allowed:
                return instance
        raise AssertionError("candidates are never empty here")

    async def probe(self, client: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
        """Ask every instance's /health; healthy again when it answers 200. An engine
        process other than the one seen before means the server restarted: what it
        held is forgotten."""
        for instance in self.instances:
            try:
                response = await client.get(f"{instance.url}/health", timeout=timeout_s)
                ok = response.status_code == 200
                error = None if ok else f"/health answered {response.status_code}"
            except httpx.HTTPError as exc:
                ok, error = False, f"/health failed: {type(exc).__name__}: {exc}"
            if ok:
                self._note_engine(instance, response)
                instance.healthy = True
            elif instance.healthy:
                instance.mark_failed(error)
            else:
                instance.last_error = error

    @staticmethod
    def _note_engine(instance: Instance, response: httpx.Response) -> None:
        try:
            pid = response.json().get("engine_pid")
        except (ValueError, AttributeError):
            return
        if isinstance(pid, int) and pid != instance.engine_pid:
            if instance.engine_pid is not None:
                instance.forget_cache()
            instance.engine_pid = pid
