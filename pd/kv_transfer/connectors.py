"""The KV connectors by name (`--kv-connector NAME`), in the shape of every registry
(pd/registry.py). An entry is a `pd.contracts.connector_api.KVConnector`, which builds the
connector's two halves, worker side then scheduler side, from a `ConnectorContext`:

- `null`: `NullConnector`, for a server that serves alone (`--role both`); it is called
  at the same fixed points as any other and moves nothing.
- `nixl`: the NIXL connector (connectors/nixl/), for prefill and decode servers.
"""

from __future__ import annotations

from pd.registry import Registry

KV_CONNECTORS = Registry("KV connector", {
    "null": "pd.contracts.connector_api:NullConnector",
    "nixl": "connectors.nixl.connector:NixlConnector",
})
NULL_CONNECTOR = "null"
AUTO_CONNECTOR = "auto"  # nixl for --role prefill / decode, null for --role both
