"""The `error.code` of a server's JSON error body that the proxy reads, and those the
engine sends the server with a refused or failed request."""

from __future__ import annotations

# From the engine, turned into an HTTP status by the server (pd/server/app.py).
INVALID_REQUEST = "invalid_request"  # refused: the request itself is unservable (400)
KV_HELD_LIMIT = "kv_held_limit"  # refused: P keeps too many blocks for decode servers (503, Retry-After)
KV_LOAD_FAILED = "kv_load_failed"  # failed: its KV could not be loaded from the prefill server (502)
INTERNAL_ERROR = "internal_error"  # refused or failed: a fault in the engine while serving it (500)

# From the server: the engine itself failed, not the request (the proxy may try another).
ENGINE_DEAD = "engine_dead"  # 503: the engine was dead before the request reached the server
ENGINE_DIED = "engine_died"  # 500: it died while serving the request
SERVER_DRAINING = "server_draining"  # 503: the server is draining (stopping): nothing of the request was done
MIGRATED = "migrated"  # a stream's error event: the server is draining; it goes on elsewhere from its KV

# Either side.
REQUEST_TOO_LARGE = "request_too_large"  # 413: the body is past the receiver's limit
NO_INSTANCE = "no_instance"  # 503 from the proxy: no server of a role is in its fleet (none joined yet)
OVERLOADED = "overloaded"  # 429: no room for the request now; Retry-After says when to try again
