"""What one `pd proxy` is configured with, validated once."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from proxy.body import MAX_DEPTH
from proxy.canary import TIE_LOGPROB
from proxy.disagg import DISAGG_POLICIES, LOCAL_PREFILL_MAX_TOKENS, REUSE_MIN_TOKENS
from proxy.fleet import FLEET_ALLOW, allowed_networks
from proxy.instances import LOAD_SLACK, POLICIES
from proxy.kv_index import DEFAULT_TIER_WEIGHTS
from wire.body import DEFAULT_LIMIT

MEDIA = tuple(DEFAULT_TIER_WEIGHTS)  # device, host, disk (kv_events/messages.py Medium)


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    policy: str = "round_robin"
    prefill_policy: str | None = None  # None: `policy`
    decode_policy: str | None = None  # None: `policy`; kv_aware under conditional disaggregation
    kv_overlap_weight: float = 1.0  # kv_aware: a prompt token held, against a token of load
    decode_load_tokens: int = 256  # kv_aware: the load one request being decoded counts for
    load_slack: int = LOAD_SLACK  # prefix_aware, kv_aware: requests in flight above the least loaded tolerated
    api_key: str | None = None  # what clients must send; None: no check
    server_api_key: str | None = None  # what the proxy sends the servers; None: api_key
    probe_interval_s: float = 5.0
    timeout_s: float = 600.0  # one request to a server
    prefill_timeout_s: float | None = None  # the prefill phase (None: timeout_s)
    decode_timeout_s: float | None = None  # the decode phase: between bytes of D's answer (None: timeout_s)
    max_retries: int = 2  # other prefill servers tried after one failed
    retry_backoff_s: float = 0.05  # before retry k: this x 2^(k-1) x [1, 2)
    migration_limit: int = 3  # times a request whose decode server failed is resumed on another (migration.py)
    breaker_failures: int = 1  # failures in a row that open a server's breaker
    breaker_cooldown_s: float = 5.0  # before an open breaker lets a trial through
    max_outstanding: int = 0  # requests in flight per server at most; past it on every one: queued (0: no limit)
    max_queue: int = 1024  # requests waiting for room at most; past it: 429 (0: no queue, no room is a 429 / 503)
    queue_timeout_s: float = 600.0  # the longest a request waits for room; then 429
    max_client_priority: int = 0  # the most urgent (lowest) `priority` a client may send; lower: 400
    release_timeout_s: float = 5.0  # one `/v1/kv/release` to a prefill server
    max_request_bytes: int = DEFAULT_LIMIT
    max_depth: int = MAX_DEPTH  # of a request body's nested objects and arrays
    disagg_policy: str = "always"  # or "conditional": D prefills itself what it lacks little of (disagg.py)
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # conditional: D computes at most this many itself
    reuse_min_tokens: int = REUSE_MIN_TOKENS  # conditional: P reads a prefix from D holding this many more (0: never)
    kv_tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))  # kv_aware
    canary_fraction: float = 0.0  # of greedy or seeded PD requests also run colocated and compared (canary.py)
    canary_max_inflight: int = 2  # canaries running at once at most; a request sampled past it is skipped
    canary_tie_logprob: float = TIE_LOGPROB  # a PD token this close to the reference's is a tie, not a mismatch
    admin_key: str | None = None  # what the admin API (fleet_api.py) needs; None: the admin API is off
    fleet_secret: str | None = None  # what registrations are signed with; None: registration is off
    fleet_allow: tuple[str, ...] = FLEET_ALLOW  # networks registrations may come from and instances be in

    def __post_init__(self) -> None:
        if not (self.prefill_urls and self.decode_urls) and self.admin_key is None and self.fleet_secret is None:
            raise ValueError("at least one prefill and one decode server are needed, or a way for them to join "
                             "later: --admin-key (the admin API) or --fleet-secret (servers started with --register)")
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            twice = sorted({url for url in urls if urls.count(url) > 1})
            if twice:
                raise ValueError(f"{', '.join(twice)} given more than once as --{role}")
        both = sorted(set(self.prefill_urls) & set(self.decode_urls))
        if both:
            raise ValueError(f"{', '.join(both)} given as --prefill and as --decode: an instance has one role at a "
                             "time (start it --role both and switch its role with the admin API)")
        allowed_networks(self.fleet_allow)  # ValueError naming a malformed one
        for name in ("policy", "prefill_policy", "decode_policy"):
            if getattr(self, name) not in (*POLICIES, *([None] if name != "policy" else [])):
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}, got {getattr(self, name)!r}")
        if self.kv_overlap_weight < 0 or self.decode_load_tokens < 0 or self.load_slack < 0:
            raise ValueError("the kv_aware weights and the load slack must not be negative")
        if min(self.probe_interval_s, self.timeout_s, self.release_timeout_s, self.phase_timeout_s("prefill"),
               self.phase_timeout_s("decode"), self.breaker_cooldown_s) <= 0:
            raise ValueError("the probe interval, the timeouts and the breaker's cool-down must be positive")
        if min(self.max_retries, self.retry_backoff_s, self.max_outstanding, self.max_queue, self.migration_limit) < 0:
            raise ValueError("max_retries, the retry backoff, max_outstanding, max_queue and the migration limit must "
                             "not be negative")
        if not -2**31 <= self.max_client_priority < 2**31:
            raise ValueError(f"the most urgent client priority must be an integer of 32 bits, got "
                             f"{self.max_client_priority}")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"the queue timeout must be positive, got {self.queue_timeout_s}")
        if not 0.0 <= self.canary_fraction <= 1.0:
            raise ValueError(f"the canary fraction must be within 0 and 1, got {self.canary_fraction}")
        if self.canary_max_inflight < 1 or not self.canary_tie_logprob >= 0.0:
            raise ValueError("the canaries in flight must be at least 1 and the tie logprob not negative")
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures must be at least 1, got {self.breaker_failures}")
        if self.max_request_bytes <= 0:
            raise ValueError(f"the request size limit must be positive, got {self.max_request_bytes}")
        if not 1 <= self.max_depth <= 256:  # the depth check recurses this deep
            raise ValueError(f"the nesting limit must be within 1 and 256, got {self.max_depth}")
        if self.disagg_policy not in DISAGG_POLICIES:
            raise ValueError(f"disagg_policy must be one of {', '.join(DISAGG_POLICIES)}, got {self.disagg_policy!r}")
        unknown = set(self.kv_tier_weights) - set(MEDIA)
        if unknown or any(not 0 <= w <= 1e6 for w in self.kv_tier_weights.values()):
            raise ValueError(f"kv_tier_weights: media are {', '.join(MEDIA)} with weights >= 0, "
                             f"got {self.kv_tier_weights}")
        if self.local_prefill_max_tokens < 0 or self.reuse_min_tokens < 0:
            raise ValueError("local_prefill_max_tokens and reuse_min_tokens must not be negative, got "
                             f"{self.local_prefill_max_tokens} and {self.reuse_min_tokens}")
        if "" in (self.api_key, self.server_api_key, self.admin_key, self.fleet_secret):
            raise ValueError("an API key, the admin key and the fleet secret must not be empty")

    def role_policy(self, role: str) -> str:
        """The policy picking `role`'s instances: its own, else `policy`; but decode servers
        under conditional disaggregation are picked kv_aware unless told otherwise (the next
        turn goes to the one holding the last, which prefills it itself: round robin would
        send it where nothing is held)."""
        asked = self.prefill_policy if role == "prefill" else self.decode_policy
        if asked is None and role == "decode" and self.disagg_policy == "conditional":
            return "kv_aware"
        return asked or self.policy

    def phase_timeout_s(self, phase: str) -> float:
        """The prefill phase's timeout, or the decode phase's (between bytes of D's answer):
        its own, else `timeout_s`."""
        asked = self.prefill_timeout_s if phase == "prefill" else self.decode_timeout_s
        return self.timeout_s if asked is None else asked

    @property
    def needs_tokens(self) -> bool:
        """Whether routing reads the servers' KV events (and so needs requests' tokens):
        a kv_aware policy, or conditional disaggregation (D's events)."""
        return "kv_aware" in (self.role_policy("prefill"), self.role_policy("decode")) \
            or self.disagg_policy == "conditional"

    def follows_events(self, role: str) -> bool:
        """Whether the proxy follows the KV events of the servers of `role`: a kv_aware
        side's, and the decode servers' under conditional disaggregation (what D holds
        decides where a prompt is computed). Not P's for that alone: what P is expected
        to hold would make its queue look shorter than the prompts it computes (measured:
        fewer first turns on D, TTFT of later turns 1.88x better than `always` where it is
        2.00x without)."""
        return self.role_policy(role) == "kv_aware" or (role == "decode" and self.disagg_policy == "conditional")

    @property
    def server_authorization(self) -> str | None:
        """The Authorization header towards the servers; None: forward the client's."""
        key = self.server_api_key if self.server_api_key is not None else self.api_key
        return f"Bearer {key}" if key is not None else None


# What a `pd proxy` flag defaults to is the field's default: one place for both.
PROXY_DEFAULTS = {f.name: f.default for f in fields(ProxyConfig) if f.default is not MISSING}


def tier_weights(text: str) -> dict[str, float]:
    """`device=1,host=0.8,disk=0.5` as a dict (media not named keep their defaults)."""
    weights = dict(DEFAULT_TIER_WEIGHTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        medium, _, value = part.partition("=")
        try:
            weights[medium.strip()] = float(value)  # no "=": float("") fails too
        except ValueError:
            raise ValueError(f"--kv-tier-weights: {part!r} is not MEDIUM=WEIGHT") from None
    return weights
