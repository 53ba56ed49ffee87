"""What one `pd proxy` is configured with, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.body import MAX_DEPTH, MAX_REQUEST_BYTES
from proxy.instances import POLICIES


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    policy: str = "round_robin"
    api_key: str | None = None  # what clients must send; None: no check
    server_api_key: str | None = None  # what the proxy sends the servers; None: api_key
    probe_interval_s: float = 5.0
    timeout_s: float = 600.0  # one request to a server
    release_timeout_s: float = 5.0  # one `/v1/kv/release` to a prefill server
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_depth: int = MAX_DEPTH  # of a request body's nested objects and arrays

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("at least one prefill and one decode server are needed")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if min(self.probe_interval_s, self.timeout_s, self.release_timeout_s) <= 0:
            raise ValueError("the probe interval and the timeouts must be positive")
        if self.max_request_bytes <= 0:
            raise ValueError(f"the request size limit must be positive, got {self.max_request_bytes}")
        if not 1 <= self.max_depth <= 256:  # the depth check recurses this deep
            raise ValueError(f"the nesting limit must be within 1 and 256, got {self.max_depth}")
        if "" in (self.api_key, self.server_api_key):
            raise ValueError("an API key must not be empty")

    @property
    def server_authorization(self) -> str | None:
        """The Authorization header towards the servers; None: forward the client's."""
        key = self.server_api_key if self.server_api_key is not None else self.api_key
        return f"Bearer {key}" if key is not None else None
