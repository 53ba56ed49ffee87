"""What a KV connector is configured with: where its side channel listens, how long P
keeps blocks for a reader, how long D waits for a read, the UCX transports, the
deployment's transfer secret and whether held KV is digested for its readers.
`EngineConfig.connector_config()` fills it from the flags; a connector sees nothing
else of the engine's settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ConnectorConfig:
    host: str = "127.0.0.1"  # the side channel binds it and P advertises it to D
    side_channel_port: int = 0  # 0: any free port
    lease_seconds: float = 60.0  # P frees blocks no decode server read after this long
    read_timeout_s: float = 30.0  # D: a read still under way after this long fails
    ucx_transports: str = "auto"  # UCX_TLS for the NIXL agent; auto: shared memory + tcp on loopback
    secret: str | None = field(default=None, repr=False)  # signs kv_transfer_params; None: unsigned
    digest: bool = False  # digest the KV held for readers (pd/kv_transfer/digests.py); readers check what they get
