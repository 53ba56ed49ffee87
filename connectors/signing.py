"""Who may make a decode server read KV: signed PD parameters and the peers it trusts.

With a secret shared by the deployment (`--kv-transfer-secret`, or the environment
variable PD_KV_TRANSFER_SECRET), P signs what it returns: an HMAC-SHA256 over every field
of `RemotePrefillParams` (the signature field itself aside), which include a digest of the
prompt's token ids and the lease's end. D refuses, before it connects anywhere:

- parameters without a signature, or whose signature does not match (forged, or any
  field changed: another host or port, other block ids, another request id);
- parameters past their lease (expired);
- parameters it has accepted before (replayed), remembered until their lease ends;
- parameters presented with another prompt than the one P prefilled (the digest), so a
  client holding valid parameters of request X cannot read X's KV under its own prompt.

Without a secret, D trusts parameters only when they name a peer in its allowed networks
(`--kv-allowed-peers`, default loopback): it never connects elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from connectors.params import RemotePrefillParams

SECRET_ENV = "PD_KV_TRANSFER_SECRET"
DEFAULT_ALLOWED_PEERS = ("127.0.0.0/8", "::1/128")
_encoder = msgspec.msgpack.Encoder()


class TransferParamsRefused(ValueError):
    """Parameters this decode server will not act on (the server answers 403)."""


def secret_from_env() -> str | None:
    return os.environ.get(SECRET_ENV) or None


def prompt_digest(prompt_token_ids: Sequence[int]) -> str:
    """sha256 hex of the prompt's token ids (little-endian int32 each)."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt_token_ids)
    return hashlib.sha256(data).hexdigest()


def _mac(params: RemotePrefillParams, secret: str) -> str:
    fields = msgspec.structs.asdict(params)
    fields.pop("signature")
    message = _encoder.encode(sorted(fields.items()))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(params: RemotePrefillParams, secret: str) -> RemotePrefillParams:
    return msgspec.structs.replace(params, signature=_mac(params, secret))


class TransferParamsGuard:
    """D's check of the remote-prefill parameters a request brings, before anything of
    them is used: signed by the deployment's secret (and not expired, replayed or moved
    to another prompt), or, without a secret, naming an allowed peer."""

    def __init__(self, secret: str | None, allowed_peers: Sequence[str] = DEFAULT_ALLOWED_PEERS,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.allowed = [ipaddress.ip_network(p, strict=False) for p in allowed_peers]
        self.wall_clock = wall_clock
        self._seen: dict[str, float] = {}  # signature -> lease end
        self._seen_order: deque[tuple[float, str]] = deque()  # (lease end, signature), oldest first

    def check(self, params: RemotePrefillParams, prompt_token_ids: Sequence[int]) -> None:
        """Raises TransferParamsRefused saying why these parameters are not acted on."""
        if self.secret is None:
            self._check_peer(params.remote_host)
            return
        if params.signature is None:
            raise TransferParamsRefused("kv_transfer_params are not signed (this server requires signed parameters)")
        if not hmac.compare_digest(params.signature, _mac(params, self.secret)):
            raise TransferParamsRefused("kv_transfer_params carry a signature that does not match them")
        now = self.wall_clock()
        if params.lease_expires_at is None or params.lease_expires_at <= now:
            raise TransferParamsRefused("kv_transfer_params have expired (the prefill server's lease ended)")
        if params.prompt_digest != prompt_digest(prompt_token_ids):
            raise TransferParamsRefused("kv_transfer_params were issued for another prompt")
        self._forget_expired(now)
        if params.signature in self._seen:
            raise TransferParamsRefused("kv_transfer_params were used already (a replay)")
        self._seen[params.signature] = params.lease_expires_at
        self._seen_order.append((params.lease_expires_at, params.signature))

    def _forget_expired(self, now: float) -> None:
        """Drop signatures whose lease ended (they are refused as expired anyway); leases
        are issued with one length, so the oldest entries end first."""
        while self._seen_order and self._seen_order[0][0] <= now:
            _, signature = self._seen_order.popleft()
            if self._seen.get(signature, now + 1) <= now:
                del self._seen[signature]

    def _check_peer(self, host: str) -> None:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise TransferParamsRefused(f"remote_host {host!r} is not an IP address of an allowed peer") from None
        if not any(address in network for network in self.allowed):
            raise TransferParamsRefused(f"remote_host {host} is not an allowed peer of this server "
                                        "(see --kv-allowed-peers, or sign parameters with --kv-transfer-secret)")
