"""The compatibility hash: equal on two engines whose KV blocks mean the same thing byte
for byte, so that one may read the other's blocks. The engine computes it once and hands
it to its connector (`ConnectorContext.compat_hash`) and to routers (`/v1/router/info`);
the NIXL connector refuses a peer whose hash differs."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_COMPAT_VERSION = "pd-kv-compat-v2"  # v2: heads outermost in a block (pd/kv_cache/row_order.py)
_encoder = msgspec.msgpack.Encoder()


def compat_hash(
    model_id: str,
    dtype: str,
    block_sizes: Sequence[int],
    layout: str,
    group_specs_repr: Sequence[str],
) -> str:
    """sha256 hex of everything that decides what a block's bytes mean.

    Two engines can exchange KV blocks iff their hashes are equal. The inputs are encoded
    as one msgpack array (deterministic for these types), with a version tag so a change
    of what is hashed never makes old and new engines look compatible.
    """
    fields = [_COMPAT_VERSION, model_id, dtype, [int(b) for b in block_sizes], layout, list(group_specs_repr)]
    return hashlib.sha256(_encoder.encode(fields)).hexdigest()
