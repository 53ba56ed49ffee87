"""Why a request was refused (never admitted) or failed (admitted, then ended with
finish_reason "error"): the engine sends such an output with a code of the wire contract
(wire/codes.py: invalid_request, kv_held_limit, kv_load_failed, internal_error), which the
server turns into an HTTP status."""

from __future__ import annotations


class HeldBlocksLimitError(Exception):
    """A prefill for a decode server is refused: this server already keeps its share of
    blocks (`kv_max_held_fraction`) for requests no decode server has read yet."""
