"""The compatibility hash: equal on two engines whose KV blocks mean the same thing byte
for byte, so that one may read the other's blocks. The engine computes it once and hands
it to its connector (`ConnectorContext.compat_hash`) and to routers (`/v1/router/info`);
the NIXL connector refuses a peer whose hash differs."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

# v2: heads outermost in a block (pd/kv_cache/row_order.py); v3: the weights and their quantization
_COMPAT_VERSION = "pd-kv-compat-v3"
_encoder = msgspec.msgpack.Encoder()
# What a refusal of a peer whose hash differs says of why (each server logs its hash at start)
COMPAT_DIFFERS = ("the two engines' model config, weights, quantization, dtype, KV dtype, block sizes or layout "
                  "differ; each server logs its KV compatibility hash at start")


def compat_hash(
    model_id: str,
    weights: str,
    quantization: str,
    dtype: str,
    block_sizes: Sequence[int],
    layout: str,
    group_specs_repr: Sequence[str],
) -> str:
    """sha256 hex of everything that decides what a block's bytes mean: the model's config
    (`model_id`), a fingerprint of its weights (pd/models/fingerprint.py), how its linears
    compute (`quantization`), the dtype, and the KV cache's blocks, layout and groups (their
    specs name the KV dtype).

    Two engines can exchange KV blocks iff their hashes are equal. The inputs are encoded
    as one msgpack array (deterministic for these types), with a version tag so a change
    of what is hashed never makes old and new engines look compatible.
    """
    fields = [_COMPAT_VERSION, model_id, weights, quantization, dtype, [int(b) for b in block_sizes], layout,
              list(group_specs_repr)]
    return hashlib.sha256(_encoder.encode(fields)).hexdigest()
