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

Without a secret (`--allow-unsigned-kv-params`), D trusts parameters only when they name a
peer in its allowed networks (`--kv-allowed-peers`, default loopback): it never connects
elsewhere; and it keeps what it reads under them out of its prefix cache. With a secret
and `--kv-allowed-peers` given, the parameters must be signed and name such a peer. In
every mode D refuses parameters whose prompt digest is not its request's prompt's.

The side channel's handshake (connectors/nixl/handshake.py) is held to the same peers
from the other end, and with a secret carries a proof of it (`handshake_proof`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from pd.kv_transfer.params import RemotePrefillParams
from wire.fleet import SECRET_ENV
from wire.kv_params import SIGNATURE

DEFAULT_ALLOWED_PEERS = ("127.0.0.0/8", "::1/128")
_encoder = msgspec.msgpack.Encoder()


class UntilExpiry:
    """Keys (each with a value) remembered until a wall-clock end (a lease's). Expired
    keys are dropped oldest first as keys are added: leases share one length, so ends
    come in about the order keys do, and no call walks every key."""

    def __init__(self) -> None:
        self._ends: dict[str, tuple[float, str | None]] = {}  # in insertion order

    def add(self, key: str, end: float, now: float, value: str | None = None) -> None:
        while self._ends:
            oldest, (oldest_end, _) = next(iter(self._ends.items()))
            if oldest_end > now:
                break
            del self._ends[oldest]
        self._ends[key] = (end, value)

    def holds(self, key: str, now: float) -> bool:
        return self._ends.get(key, (now, None))[0] > now

    def value(self, key: str) -> str | None:
        return self._ends.get(key, (0.0, None))[1]

    def pop(self, key: str, now: float) -> bool:
        """Forget `key`; whether it was held (and not expired)."""
        return self._ends.pop(key, (now, None))[0] > now

    def __len__(self) -> int:
        return len(self._ends)


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
    fields.pop(SIGNATURE)
    message = _encoder.encode(sorted(fields.items()))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def handshake_key(secret: str) -> str:
    """The key of side-channel handshakes, derived from the deployment's secret: what a
    tensor-parallel rank is given (it never holds the secret, which signs parameters)."""
    return hmac.new(secret.encode(), b"pd-kv-handshake", hashlib.sha256).hexdigest()


def handshake_proof(key: str, engine_id: str, compat_hash: str, sent_at: float) -> str:
    """What a side-channel handshake carries to show that its sender holds the
    deployment's secret: an HMAC-SHA256, under `handshake_key`, of who asks, for which
    layout, and when."""
    message = _encoder.encode(["handshake", engine_id, compat_hash, sent_at])
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def sign(params: RemotePrefillParams, secret: str) -> RemotePrefillParams:
    return msgspec.structs.replace(params, signature=_mac(params, secret))


class TransferParamsGuard:
    """D's check of the remote-prefill parameters a request brings, before anything of
    them is used: signed by the deployment's secret (and not expired, replayed or moved
    to another prompt), or, without a secret, naming an allowed peer."""

    def __init__(self, secret: str | None, allowed_peers: Sequence[str] | None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """`allowed_peers`: the networks D reads from (TransferSettings.peer_networks);
        None (only with a secret): any host the signed parameters name."""
        if secret is None and allowed_peers is None:
            raise ValueError("without a secret, the peers trusted must be given")
        self.secret = secret
        self.allowed = None if allowed_peers is None else [ipaddress.ip_network(p, strict=False)
                                                           for p in allowed_peers]
        self.wall_clock = wall_clock
        self._seen = UntilExpiry()  # signatures used, until their lease ends
        self._lock = threading.Lock()  # servers check requests in worker threads: one check at a time

    def check(self, params: RemotePrefillParams, prompt_token_ids: Sequence[int]) -> None:
        """Raises TransferParamsRefused saying why these parameters are not acted on."""
        with self._lock:  # a replay is told from a first use by what was seen: check and note at once
            self._check(params, prompt_token_ids)

    def _check(self, params: RemotePrefillParams, prompt_token_ids: Sequence[int]) -> None:
        if params.prompt_digest != prompt_digest(prompt_token_ids):  # in every mode: never another prompt's KV
            raise TransferParamsRefused("kv_transfer_params were issued for another prompt")
        if self.allowed is not None:
            self._check_peer(params.remote_host)
        if self.secret is None:
            return
        if params.signature is None:
            raise TransferParamsRefused("kv_transfer_params are not signed (this server requires signed parameters)")
        if not hmac.compare_digest(params.signature, _mac(params, self.secret)):
            raise TransferParamsRefused("kv_transfer_params carry a signature that does not match them")
        now = self.wall_clock()
        if params.lease_expires_at is None or params.lease_expires_at <= now:
            raise TransferParamsRefused("kv_transfer_params have expired (the prefill server's lease ended)")
        if self._seen.holds(params.signature, now):
            raise TransferParamsRefused("kv_transfer_params were used already (a replay)")
        self._seen.add(params.signature, params.lease_expires_at, now)

    def _check_peer(self, host: str) -> None:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise TransferParamsRefused(f"remote_host {host!r} is not an IP address of an allowed peer") from None
        if not any(address in network for network in self.allowed):
            signing = "" if self.secret else ", or sign parameters with --kv-transfer-secret"
            raise TransferParamsRefused(f"remote_host {host} is not an allowed peer of this server (see "
                                        f"--kv-allowed-peers{signing})")
