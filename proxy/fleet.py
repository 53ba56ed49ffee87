"""The proxy's live set of instances: who is in the fleet, in which role, and who is leaving.

Instances join three ways: the static `--prefill/--decode` lists, the admin API
(`fleet_api.py`, behind `--admin-key`), and registration (`pd serve --register URL`: a
signed message renewed every few seconds, `wire/fleet.py`). Each is in one pool, its
role's, at a time.

- **drain**: it takes no new request; what it holds finishes. Undrained, it takes
  requests again.
- **remove**: drained first; it leaves the pool once the proxy has nothing in flight on
  it (never during that), or at once when forced.
- **role**: a server that may serve both roles (registered with both, or added so) moves
  to the other pool. Requests in flight keep the instance they were sent to; new ones see
  its new role. A server with one role refuses with 409.
- **lease**: a registered instance whose renewals stop is out of the pool when its lease
  ends (presumed dead: requests in flight on it fail or are retried on their own).

A pool following KV events (`ProxyConfig.follows_events`) has a follower task per instance
(`kv_subscriber.py`), started when one joins or takes the role and cancelled when it
leaves. Every change is a `Change` kept in `changes` (the dashboard's) and counted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from proxy.instances import Instance, InstancePool
from wire.fleet import FRESH_S, MAX_REASON, ROLES, PlannerDecision, Registration

logger = logging.getLogger(__name__)

FLEET_ALLOW = ("127.0.0.0/8", "::1/128")  # --fleet-allow's default: this host
KEPT_CHANGES = 200
KEPT_DECISIONS = 50
ACTIONS = ("joined", "renewed", "drained", "undrained", "removed", "expired", "role")  # pd_proxy_fleet_changes


class FleetError(Exception):
    """A membership change refused: `status` is the HTTP answer (400, 403, 404, 409)."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class Change:
    at: float  # wall clock
    url: str
    action: str  # one of ACTIONS
    role: str
    reason: str

    def state(self) -> dict:
        return asdict(self)


def allowed_networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    try:
        return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)
    except ValueError as exc:
        raise ValueError(f"--fleet-allow: {exc}") from None


def in_networks(host: str, networks: tuple) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in networks)


def instance_url(url: str, networks: tuple) -> str:
    """`url` as the proxy keys an instance (`http://host:port`); FleetError 400 for a URL
    that is not one, 403 for a host outside the allowed networks (an IP address only:
    a name could resolve anywhere)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.path.strip("/") or parts.query or parts.fragment or parts.username or parts.password:
        raise FleetError(f"{url[:200]!r} is not a server's base URL (http://ADDRESS:PORT)", 400, "invalid_url")
    if not in_networks(parts.hostname, networks):
        raise FleetError(f"{parts.hostname} is not an address in the fleet's allowed networks (--fleet-allow)", 403,
                         "address_not_allowed")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass
class Fleet:
    """Membership of the two pools; `on_join` / `on_leave` start and stop what follows an
    instance (its KV events) and are set by the app once its HTTP client exists."""

    pools: dict[str, InstancePool]
    make_instance: Callable[[str, str], Instance]  # (url, role): with the proxy's breaker and tier weights
    networks: tuple = ()
    on_change: Callable[[Change], None] = lambda change: None
    on_join: Callable[[Instance], None] = lambda instance: None
    on_leave: Callable[[Instance], None] = lambda instance: None
    changes: deque = field(default_factory=lambda: deque(maxlen=KEPT_CHANGES))
    decisions: deque = field(default_factory=lambda: deque(maxlen=KEPT_DECISIONS))  # a planner's, newest last
    leaving: set[str] = field(default_factory=set)  # URLs removed once nothing is in flight on them
    _last_sent_at: dict[str, float] = field(default_factory=dict)  # per URL: the newest registration taken
    clock: Callable[[], float] = time.monotonic

    def members(self) -> Iterator[Instance]:
        for pool in self.pools.values():
            yield from pool.instances

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.members() if i.url == url.rstrip("/")), None)

    def get(self, url: str) -> Instance:
        instance = self.find(url)
        if instance is None:
            raise FleetError(f"no instance {url[:200]!r} is in the fleet", 404, "unknown_instance")
        return instance

    def add(self, url: str, role: str, roles: tuple[str, ...] = (), source: str = "admin",
            reason: str = "admin") -> Instance:
        """A new instance in `role`'s pool; 409 if the URL is in the fleet already."""
        url = instance_url(url, self.networks)
        roles = roles or (role,)
        if role not in ROLES or not set(roles) <= set(ROLES) or role not in roles:
            raise FleetError(f"role must be one of {', '.join(ROLES)} and among its roles, got {role!r} of "
                             f"{list(roles)}", 400, "invalid_role")
        if self.find(url) is not None:
            raise FleetError(f"{url} is in the fleet already", 409, "instance_exists")
        instance = self.make_instance(url, role)
        instance.roles, instance.source = tuple(roles), source
        self.pools[role].add(instance)
        self._record(instance, "joined", f"{reason}, roles {'+'.join(roles)}")
        self.on_join(instance)
        return instance

    def drain(self, url: str, draining: bool = True, reason: str = "admin") -> Instance:
        instance = self.get(url)
        if instance.url in self.leaving and not draining:
            raise FleetError(f"{instance.url} is being removed: it cannot take requests again", 409, "leaving")
        if instance.draining != draining:
            instance.draining = draining
            self._record(instance, "drained" if draining else "undrained", reason)
        return instance

    def remove(self, url: str, force: bool = False, reason: str = "admin") -> bool:
        """Drain the instance and take it out once nothing is in flight on it (now, if
        nothing is or `force`); whether it is out already."""
        instance = self.drain(url, reason=reason)
        self.leaving.add(instance.url)
        if force or instance.in_flight == 0:
            self._take_out(instance, "removed", reason if not force else f"{reason}, forced")
            return True
        return False

    def set_role(self, url: str, role: str, reason: str = "admin") -> Instance:
        instance = self.get(url)
        if role not in ROLES:
            raise FleetError(f"role must be one of {', '.join(ROLES)}, got {role!r}", 400, "invalid_role")
        if role not in instance.roles:
            raise FleetError(f"{instance.url} serves only as {'+'.join(instance.roles)} (a server started with "
                             f"--role {instance.roles[0]}); only a --role both server with a KV connector switches "
                             "roles", 409, "fixed_role")
        if instance.role != role:
            self.on_leave(instance)
            self.pools[instance.role].remove(instance)
            self.pools[role].add(instance)
            self._record(instance, "role", reason)
            self.on_join(instance)
        return instance

    def register(self, registration: Registration, now_wall: float) -> Instance:
        """A registration or its renewal, checked (`Registration.check`, the URL allowed,
        newer than the last taken from it, its KV compatibility hash the fleet's)."""
        try:
            registration.check()
        except ValueError as exc:
            raise FleetError(str(exc), 400, "invalid_registration") from None
        url = instance_url(registration.url, self.networks)
        if abs(now_wall - registration.sent_at) > FRESH_S:
            raise FleetError(f"a registration sent {now_wall - registration.sent_at:.0f} s from the proxy's clock "
                             f"(more than {FRESH_S:.0f} s: clocks apart, or played back)", 403, "stale_registration")
        if registration.sent_at <= self._last_sent_at.get(url, float("-inf")):
            raise FleetError("a registration older than one taken already (played back?)", 409, "stale_registration")
        others = {i.info.get("compat_hash") for i in self.members() if i.url != url and i.info.get("compat_hash")}
        if registration.compat_hash and others and registration.compat_hash not in others:
            raise FleetError(f"KV compatibility hash {registration.compat_hash[:12]} differs from the fleet's "
                             f"({', '.join(h[:12] for h in others)}): its KV cannot be exchanged with theirs", 409,
                             "incompatible_kv")
        instance = self.find(url)
        if instance is None:
            if registration.state == "leaving":
                raise FleetError(f"{url} is not in the fleet", 404, "unknown_instance")
            instance = self.add(url, registration.role, tuple(registration.roles), "registered", "registered")
        elif instance.source == "registered" and instance.url not in self.leaving:
            self._record(instance, "renewed", "registration", quiet=True)
        instance.source, instance.roles = "registered", tuple(registration.roles)
        instance.lease_end = self.clock() + registration.lease_s
        instance.info = {"tp": registration.tp, "compat_hash": registration.compat_hash,
                         "engine_pid": registration.engine_pid, "lease_s": registration.lease_s}
        self._last_sent_at[url] = registration.sent_at
        if instance.role not in instance.roles:  # it restarted with other roles
            self.set_role(url, registration.role, reason="registered without its role")
        if registration.state == "draining":
            self.drain(url, reason="the server is draining")
        elif registration.state == "leaving":
            self.remove(url, reason="the server is leaving")
        return instance

    def tick(self) -> None:
        """Take out what is due: leases ended, removals whose requests have finished."""
        now = self.clock()
        for instance in list(self.members()):
            if instance.lease_end is not None and now > instance.lease_end:
                self._take_out(instance, "expired", f"no renewal within its {instance.info.get('lease_s')} s lease")
            elif instance.url in self.leaving and instance.in_flight == 0:
                self._take_out(instance, "removed", "drained")

    async def run(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.tick()

    def _take_out(self, instance: Instance, action: str, reason: str) -> None:
        instance.gone = True  # a stream still open on it (a server cut off, silent) is given up (migration.py)
        self.on_leave(instance)
        self.pools[instance.role].remove(instance)
        self.leaving.discard(instance.url)
        self._record(instance, action, reason)

    def decided(self, decision: PlannerDecision) -> None:
        """A planner's decision, kept for the dashboard and the admin API."""
        try:
            decision.check()
        except ValueError as exc:
            raise FleetError(str(exc), 400, "invalid_decision") from None
        self.decisions.append((time.time(), decision))

    def _record(self, instance: Instance, action: str, reason: str, quiet: bool = False) -> None:
        change = Change(time.time(), instance.url, action, instance.role, reason[:MAX_REASON])
        if not quiet:
            self.changes.append(change)
            logger.info("fleet: %s %s (%s): %s", instance.url, action, instance.role, reason)
        self.on_change(change)

    def state(self) -> dict:
        now = self.clock()
        return {"instances": [i.state() | {"leaving": i.url in self.leaving,
                                           "lease_left_s": None if i.lease_end is None else round(i.lease_end - now, 1)}
                              for i in self.members()],
                "changes": [c.state() for c in reversed(self.changes)],
                "decisions": self.recent_decisions()}

    def recent_decisions(self, limit: int = KEPT_DECISIONS, inputs: bool = True) -> list[dict]:
        """The planner's decisions, newest first (`inputs`: with what each was decided on)."""
        return [{"at": at, "action": d.action, "url": d.url, "role": d.role, "reason": d.reason}
                | ({"inputs": d.inputs} if inputs else {}) for at, d in list(reversed(self.decisions))[:limit]]

