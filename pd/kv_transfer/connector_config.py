"""The transfer group of an engine's settings (`TransferSettings`: which connector, where
its side channel listens, how long P keeps blocks for a reader, how long D waits for a
read, the UCX transports, the deployment's secret, the peers trusted without one and
whether held KV is digested), and what a connector sees of it (`ConnectorConfig`, its
projection: a connector sees nothing else of the engine's settings).

Each setting is declared here once, with its default, and checked here once; what needs
the environment (the secret) or the role (`auto`) is resolved by `EngineConfig.resolve`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from pd.kv_transfer.connectors import AUTO_CONNECTOR, KV_CONNECTORS
from pd.kv_transfer.signing import DEFAULT_ALLOWED_PEERS, handshake_key


@dataclass(frozen=True)
class ConnectorConfig:
    """What a connector is configured with (`TransferSettings.connector_config()`)."""

    host: str  # the side channel binds it and P advertises it to D
    side_channel_port: int  # 0: any free port
    lease_seconds: float  # P frees blocks no decode server read after this long
    read_timeout_s: float  # D: a read still under way after this long fails
    ucx_transports: str  # UCX_TLS for the NIXL agent; auto: shared memory + tcp on loopback
    secret: str | None = field(repr=False)  # signs kv_transfer_params; None: unsigned
    digest: bool  # digest the KV held for readers (pd/kv_transfer/digests.py); readers check what they get
    # the networks whose handshakes the side channel answers (TransferSettings.peer_networks);
    # None: any peer, which must prove it holds the secret
    peers: tuple[str, ...] | None
    # proves the secret in side-channel handshakes (signing.py `handshake_key`); None: no secret.
    # A tensor-parallel rank keeps it when the secret is taken from its copy.
    handshake_key: str | None = field(repr=False)


@dataclass(frozen=True)
class TransferSettings:
    """How this engine moves KV to and from its peers (the `--kv-*` transfer flags)."""

    connector: str = field(default=AUTO_CONNECTOR, metadata={"flat": "kv_connector"})  # auto: by role
    host: str = field(default="127.0.0.1", metadata={"flat": "kv_host"})
    side_channel_port: int = field(default=0, metadata={"flat": "kv_side_channel_port"})
    lease_seconds: float = field(default=60.0, metadata={"flat": "kv_lease_seconds"})
    read_timeout_s: float = field(default=30.0, metadata={"flat": "kv_read_timeout"})
    ucx_transports: str = field(default="auto", metadata={"flat": "kv_ucx_transports"})
    digest: bool = field(default=False, metadata={"flat": "kv_digest"})
    # None: $PD_KV_TRANSFER_SECRET (read by EngineConfig.resolve); "": none, whatever it says
    secret: str | None = field(default=None, repr=False, metadata={"flat": "kv_transfer_secret"})
    allow_unsigned: bool = field(default=False, metadata={"flat": "allow_unsigned_kv_params"})
    # None: not given (peer_networks says what that means)
    allowed_peers: tuple[str, ...] | None = field(default=None, metadata={"flat": "kv_allowed_peers"})

    def __post_init__(self) -> None:
        if self.connector != AUTO_CONNECTOR and self.connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {AUTO_CONNECTOR}, {', '.join(KV_CONNECTORS.names())}, "
                             f"got {self.connector!r}")
        if self.lease_seconds <= 0:
            raise ValueError(f"kv_lease_seconds must be positive, got {self.lease_seconds}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"kv_read_timeout must be positive, got {self.read_timeout_s}")
        if not self.ucx_transports.strip() or any(c.isspace() for c in self.ucx_transports):
            raise ValueError(f"kv_ucx_transports must be auto or a UCX_TLS list such as sm,self,tcp, "
                             f"got {self.ucx_transports!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"kv_side_channel_port must be a TCP port (0: any free one), got {self.side_channel_port}")
        if self.allowed_peers is not None and not isinstance(self.allowed_peers, tuple):
            raise TypeError(f"kv_allowed_peers must be a tuple, got {type(self.allowed_peers).__name__}")
        for peer in self.allowed_peers or ():
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(f"kv_allowed_peers: {peer!r} is not an IP address or network") from None

    def peer_networks(self) -> tuple[str, ...] | None:
        """The networks this server moves KV with, both ways: the prefill servers it reads
        from and the readers whose handshakes its side channel answers. Those given, with
        or without a secret; none given: loopback (DEFAULT_ALLOWED_PEERS) without a secret,
        None with one (any peer: the parameters are signed, and a handshake must prove the
        secret)."""
        if self.allowed_peers is not None:
            return self.allowed_peers
        return None if self.secret else DEFAULT_ALLOWED_PEERS

    def connector_config(self) -> ConnectorConfig:
        """What the KV connector is configured with (it sees nothing else of the engine's)."""
        return ConnectorConfig(self.host, self.side_channel_port, self.lease_seconds, self.read_timeout_s,
                               self.ucx_transports, self.secret, self.digest, self.peer_networks(),
                               handshake_key(self.secret) if self.secret else None)
