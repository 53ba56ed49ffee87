"""The servers behind the proxy and how one is picked for a request.

An `Instance` is one `pd serve` (a prefill or a decode server): its URL, its circuit
breaker (`breaker.py`: failures in a row open it; after a cool-down one trial, a
request or the prober's /health, closes it again), and how many requests the proxy has
outstanding on it. `InstancePool.probe` (run periodically by the app) asks each
instance's /health. An instance with `max_outstanding` requests in flight takes no more;
when every available one is there, the pool is overloaded (the client gets a 429).

Policies pick among the available instances not excluded for this request. An
instance's requests in flight are those sent to it and, for a decode server, those bound
for it (picked before their prefill, see forward.py):

- `round_robin`: in turn.
- `least_loaded`: fewest requests in flight (ties in turn).
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

import asyncio
import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from kv_events.hashing import extend_block_hashes
from proxy.breaker import Breaker
from proxy.kv_index import DEFAULT_TIER_WEIGHTS, KVIndex

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
VIRTUAL_NODES = 64  # points per instance on the hash ring
# prefix_aware and kv_aware pass over an instance with more requests in flight than the least loaded + this
LOAD_SLACK = 3


class NoInstanceError(Exception):
    """No healthy instance is left for this request."""


class EmptyPoolError(NoInstanceError):
    """The role has no instance at all (none given, added or registered yet)."""


class OverloadedError(NoInstanceError):
    """Every healthy instance has `max_outstanding` requests in flight."""


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
    breaker: Breaker = field(default_factory=Breaker)
    outstanding: int = 0
    bound: int = 0  # picked as the decode server of requests still prefilling
    outstanding_tokens: int = 0  # prompt tokens to work through for requests in flight (kv_aware)
    requests: int = 0  # sent to it since start
    failures: int = 0
    last_error: str | None = None
    kv_index: KVIndex | None = None  # what its KV events say it holds (kv_aware)
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))  # per medium
    block_size: int = 0  # tokens per block of the indexed KV cache group
    engine_pid: int | None = None  # as its /health last said: another one means it restarted
    cache_epoch: int = 0  # counts the times what it held was forgotten (its events are followed anew)
    probed: bool = False  # its /health answered (or failed) the prober at least once
    roles: tuple[str, ...] = ()  # the roles it may be given (a `--role both` server: both); (): `role` only
    draining: bool = False  # takes no new request (fleet.py); what it holds finishes
    source: str = "static"  # how it joined: static (--prefill/--decode), admin, registered (fleet.py)
    lease_end: float | None = None  # registered: out of the fleet past this (monotonic s) without a renewal
    info: dict = field(default_factory=dict)  # what it registered with: TP size, KV compatibility hash, ...
    gone: bool = False  # taken out of the fleet (its lease ended, or removed): a stream still open on it is dead

    def __post_init__(self) -> None:
        self.roles = self.roles or (self.role,)

    @property
    def in_flight(self) -> int:
        """Requests sent to it, or bound for it: what its load and `max_outstanding` count."""
        return self.outstanding + self.bound

    @property
    def healthy(self) -> bool:
        """Not shut out by its breaker (closed, or half-open: a trial may go)."""
        return self.breaker.state != "open"

    @property
    def available(self) -> bool:
        """Healthy and not draining: new requests may go to it."""
        return self.healthy and not self.draining

    def mark_failed(self, error: str) -> bool:
        """A failure counted against its breaker; True if the breaker opened now."""
        self.failures += 1
        self.last_error = error
        opened = self.breaker.failed()
        if opened:
            self.forget_cache()
        return opened

    def mark_succeeded(self) -> None:
        self.breaker.succeeded()

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
        return int(self.kv_index.overlap(route.block_hashes(self.block_size), self.tier_weights) * self.block_size)

    def lacking_tokens(self, route: Route) -> int | None:
        """Prompt tokens of the request the instance does not hold (None when the prompt
        is not known)."""
        return None if route.tokens is None else max(0, len(route.tokens) - self.overlap_tokens(route))

    def expect(self, route: Route) -> None:
        """The request is sent to it: its prompt's blocks count as held until its events
        say (`KVIndex.expect`)."""
        if self.kv_index is not None and route.tokens is not None and self.block_size:
            self.kv_index.expect(route.block_hashes(self.block_size))

    def state(self) -> dict:
        index = self.kv_index
        indexed = None if index is None else {"blocks": len(index.blocks), "events_seq": index.last_seq,
                                              "tiers": {m: len(held) for m, held in index.lower.items()}}
        return {"url": self.url, "role": self.role, "roles": list(self.roles), "healthy": self.healthy,
                "probed": self.probed, "draining": self.draining, "source": self.source, "breaker": self.breaker.state,
                "outstanding": self.outstanding, "bound": self.bound, "outstanding_tokens": self.outstanding_tokens,
                "requests": self.requests, "failures": self.failures, "last_error": self.last_error,
                "kv_index": indexed}


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class InstancePool:
    """The instances of one role and the policy that picks among them. Instances join
    (`add`) and leave (`remove`) at runtime (`fleet.py`); the pool may be empty."""

    instances: list[Instance]
    role: str  # "prefill" or "decode"
    policy: str = "round_robin"
    overlap_weight: float = 1.0  # kv_aware: what a prompt token held is worth against a token of load
    decode_load_tokens: int = 0  # kv_aware: the load one request being decoded counts for
    max_outstanding: int = 0  # requests in flight an instance takes at most (0: no limit)
    load_slack: int = LOAD_SLACK  # prefix_aware, kv_aware: requests in flight above the least loaded tolerated
    _turn: itertools.count = field(default_factory=itertools.count, repr=False)
    _ring: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (point, instance index)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self._build_ring()

    def _build_ring(self) -> None:
        self._ring = sorted((_point(f"{inst.url}#{v}"), i) for i, inst in enumerate(self.instances)
                            for v in range(VIRTUAL_NODES))

    def add(self, instance: Instance) -> None:
        """`instance` joins the pool (its role becomes the pool's)."""
        instance.role = self.role
        self.instances.append(instance)
        self._build_ring()

    def remove(self, instance: Instance) -> None:
        """`instance` leaves the pool (requests in flight on it keep their reference)."""
        self.instances.remove(instance)
        self._build_ring()

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url), None)

    @classmethod
    def of(cls, urls: Sequence[str], role: str, policy: str, breaker: tuple[int, float] = (1, 5.0),
           tier_weights: dict[str, float] | None = None, **settings: float) -> InstancePool:
        """`breaker`: (failures in a row that open an instance's breaker, its cool-down s);
        `tier_weights`: what a block held in each medium is worth (kv_index.py)."""
        weights = tier_weights or DEFAULT_TIER_WEIGHTS
        return cls([Instance(url.rstrip("/"), role, Breaker(*breaker), tier_weights=dict(weights)) for url in urls],
                   role, policy, **settings)

    def pick(self, route: Route, exclude: set[str] = frozenset()) -> Instance:
        """An instance for a request; NoInstanceError if every one is shut out by its
        breaker or excluded, OverloadedError if the others are all full."""
        if not self.instances:
            raise EmptyPoolError(f"no {self.role} instance is in the fleet (none was given, added or registered)")
        available = [i for i in self.instances if i.url not in exclude and not i.draining and i.breaker.allows()]
        if not available:
            raise NoInstanceError(f"no healthy {self.role} instance left")
        candidates = [i for i in available if not self.max_outstanding or i.in_flight < self.max_outstanding]
        if not candidates:
            raise OverloadedError(f"every {self.role} instance has {self.max_outstanding} requests "
                                  "in flight")
        least = min(i.in_flight for i in candidates)
        if self.policy == "kv_aware":
            chosen = self._by_cache(route, [i for i in candidates if i.in_flight <= least + self.load_slack])
            if chosen:
                candidates = chosen
        if self.policy == "prefix_aware":
            chosen = self._on_ring(route.key, candidates)
            if chosen.in_flight <= least + self.load_slack:
                return chosen
        if self.policy in ("least_loaded", "prefix_aware", "kv_aware"):
            least = min(i.in_flight for i in candidates)
            candidates = [i for i in candidates if i.in_flight == least]
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
        return instance.outstanding_tokens + self.decode_load_tokens * instance.in_flight

    def _on_ring(self, key: str, candidates: list[Instance]) -> Instance:
        allowed = {id(i) for i in candidates}
        start = bisect.bisect(self._ring, (_point(key), -1))
        for k in range(len(self._ring)):
            instance = self.instances[self._ring[(start + k) % len(self._ring)][1]]
            if id(instance) in allowed:
                return instance
        raise AssertionError("candidates are never empty here")

    async def probe(self, client: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
        """Ask /health of every instance its breaker lets through (an open one past its
        cool-down is half-open: this is its trial), all at once: a 200 is a success,
        anything else a failure. An engine process other than the one seen before means
        the server restarted: what it held is forgotten."""
        await asyncio.gather(*(self._probe(instance, client, timeout_s) for instance in self.instances
                               if instance.breaker.allows()))

    async def _probe(self, instance: Instance, client: httpx.AsyncClient, timeout_s: float) -> None:
        instance.breaker.start()
        try:
            response = await client.get(f"{instance.url}/health", timeout=timeout_s)
            ok = response.status_code == 200
            error = None if ok else f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"/health failed: {type(exc).__name__}: {exc}"
        instance.probed = True
        if ok:
            self._note_engine(instance, response)
            instance.mark_succeeded()
        else:
            instance.mark_failed(error)

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
