"""Why a request was refused (never admitted) or failed (admitted, then ended with
finish_reason "error"): the codes the engine sends with such an output, which the server
turns into HTTP statuses. Imports nothing heavy: both sides of the engine wire use it."""

from __future__ import annotations

ERROR_INVALID = "invalid_request"  # refused: the request itself is unservable (400)
ERROR_KV_HELD_LIMIT = "kv_held_limit"  # refused: P keeps too many blocks for decode servers (503)
ERROR_KV_LOAD_FAILED = "kv_load_failed"  # failed: its KV could not be loaded from the prefill server (502)
ERROR_INTERNAL = "internal_error"  # refused or failed: a fault in the engine while serving it (500)


class HeldBlocksLimitError(Exception):
    """A prefill for a decode server is refused: this server already keeps its share of
    blocks (`kv_max_held_fraction`) for requests no decode server has read yet."""
