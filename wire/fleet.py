"""A server's registration with the proxy (`pd serve --register URL`): the message, and
how it is signed with the deployment's secret.

The server POSTs a `Registration` to the proxy's REGISTER_PATH when it is ready and again
every `lease_s / 3` seconds (a renewal is the same message, newer). The body is JSON; its
HMAC-SHA256 under the deployment's secret ($PD_KV_TRANSFER_SECRET, the one P and D sign
KV parameters with), as hex, goes in SIGNATURE_HEADER. A registration is fresh for
FRESH_S around the proxy's clock, and the proxy takes from one URL only registrations
sent after the last it took: a recorded one cannot be played back to undo a drain.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

SECRET_ENV = "PD_KV_TRANSFER_SECRET"  # the deployment's secret (pd/kv_transfer/signing.py, launch/process.py)
ADMIN_KEY_ENV = "PD_PROXY_ADMIN_KEY"  # the proxy's admin key, for the proxy and the planner
REGISTER_PATH = "/v1/fleet/register"
ADMIN_PATH = "/admin/instances"
DECISIONS_PATH = "/admin/planner/decisions"
DECISION_ACTIONS = ("switch", "add", "remove", "hold", "keep")  # a planner's (planner/policy.py)
MAX_REASON = 2000  # characters of a change's or a decision's reason the proxy keeps
SIGNATURE_HEADER = "X-PD-Fleet-Signature"
ROLES = ("prefill", "decode")
STATES = ("serving", "draining", "leaving")  # leaving: out of the fleet once what it holds has finished
FRESH_S = 30.0  # a registration sent further than this from the proxy's clock is refused
MIN_LEASE_S, MAX_LEASE_S = 1.0, 300.0


class Registration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: str  # the server's base URL, as the proxy reaches it
    roles: list[str]  # what it may serve: one role, or both (a `--role both` server with a connector)
    role: str  # the role it asks for when it joins (the proxy's to change later)
    sent_at: float  # wall clock, seconds since the epoch
    lease_s: float = 10.0  # out of routing this long after the last registration the proxy took
    state: str = "serving"
    tp: int = 1
    compat_hash: str = ""  # the KV compatibility hash: a fleet exchanges KV only between equal ones
    engine_pid: int = 0

    def check(self) -> None:
        """ValueError naming what is wrong."""
        if not self.roles or len(set(self.roles)) != len(self.roles) or not set(self.roles) <= set(ROLES):
            raise ValueError(f"roles must be one or both of {', '.join(ROLES)}, got {self.roles}")
        if self.role not in self.roles:
            raise ValueError(f"role {self.role!r} is not one of its roles {self.roles}")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, got {self.state!r}")
        if not MIN_LEASE_S <= self.lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be within {MIN_LEASE_S} and {MAX_LEASE_S}, got {self.lease_s}")
        if not 1 <= self.tp <= 4096 or len(self.compat_hash) > 128 or not 0 <= self.engine_pid < 2**32:
            raise ValueError("tp, compat_hash or engine_pid out of range")


def sign(secret: str, body: bytes) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signed_by(secret: str, body: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, body).encode(), signature.encode("utf-8", "replace"))


class PlannerDecision(msgspec.Struct, forbid_unknown_fields=True):
    """A planner's decision, reported to the proxy (counted, and shown on its dashboard)."""

    action: str
    reason: str
    url: str | None = None
    role: str | None = None
    inputs: dict = {}

    def check(self) -> None:
        if self.action not in DECISION_ACTIONS or len(self.reason) > MAX_REASON:
            raise ValueError(f"action must be one of {', '.join(DECISION_ACTIONS)} and the reason at most "
                             f"{MAX_REASON} characters")
