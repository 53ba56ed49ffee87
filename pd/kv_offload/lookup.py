"""The longest prefix a lower tier can add to a request's device hit.

A request admitted with `num_hit` tokens from the device and `L - num_hit` more loaded
holds, per KV cache group, blocks for positions [0, L / block_size): the device hit's,
then new ones at the positions the group still needs at L (the cache-hit rules of
pd/kv_cache/single_type_managers.py: full attention every block, a sliding window the
blocks its window reaches, Mamba the state block at L). Those new positions are what the
tier must hold; `tier_hit` finds the longest such L, aligned to every group's block size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pd.kv_cache.single_type_managers import SingleTypeKVCacheManager
from pd.kv_offload.index import Key

Hashes = Callable[[int], Sequence[bytes]]  # block size -> the request's block hashes


def needed_positions(manager: SingleTypeKVCacheManager, num_hit: int, length: int) -> range:
    """Block positions of `manager`'s group a request holding `length` computed tokens
    needs past a device hit of `num_hit` tokens."""
    size = manager.block_size
    return range(max(num_hit // size, manager.num_skipped_blocks(length)), length // size)


def tier_hit(managers: Sequence[SingleTypeKVCacheManager], holds: Callable[[Key], bool], hashes: Hashes,
             num_hit: int, max_length: int) -> int:
    """The longest L in (num_hit, max_length] such that `holds` every block the groups
    need past `num_hit` at L; `num_hit` when there is none."""
    step = math.lcm(*(m.block_size for m in managers))
    by_group = [(m, hashes(m.block_size)) for m in managers]
    upper = min([max_length, *(_full_run(m, h, holds, num_hit) for m, h in by_group if m.downward_closed)])
    for length in range(upper // step * step, num_hit, -step):
        if all(holds((h[i], m.group_id)) for m, h in by_group for i in needed_positions(m, num_hit, length)):
            return length
    return num_hit


def _full_run(manager: SingleTypeKVCacheManager, hashes: Sequence[bytes], holds: Callable[[Key], bool],
              num_hit: int) -> int:
    """Where the run of held blocks of a full-attention group from `num_hit` on ends, in tokens."""
    i = num_hit // manager.block_size
    while i < len(hashes) and holds((hashes[i], manager.group_id)):
        i += 1
    return i * manager.block_size
