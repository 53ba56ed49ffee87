"""Chained block hashes for prefix caching.

Block i of a request hashes `(hash of block i-1, its block_size token ids, extras)`, so
equal hashes mean equal whole prefixes. Hashes are 256-bit SHA-256 digests of a fixed
little-endian encoding: the same on every process and machine (no Python `hash()`, no
pickle). Only full blocks are hashed, so a hit never covers a partial block.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes
HASH_NAME = "sha256-chain-v1"  # what /v1/kv_config calls this scheme

# The parent of block 0. A fixed value, so hashes agree across processes.
ROOT_HASH: BlockHash = hashlib.sha256(b"pd prefix cache root v1").digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b""
) -> BlockHash:
    """The hash of one full block given its parent's hash (None for block 0).

    `extra` distinguishes blocks whose tokens are equal but whose KV is not (a cache salt,
    an adapter); it is part of the hash of the block that carries it and so of every later one.
    """
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    first_block_extra: bytes = b"",
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes`.

    Incremental: only blocks past `len(hashes)` are hashed, so calling this as a
    request grows costs one hash per new full block. Returns `hashes`.
    """
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, first_block_extra if i == 0 else b""))
    return hashes
