"""From per-layer specs and a memory budget to a `KVCacheConfig`.

Three steps, each a function:

1. `unify_page_sizes`: when Mamba layers are present, attention's block_size is raised
   (kept a multiple of 16) until every attention page is at least the Mamba page; Mamba
   then uses the same block_size ("align" mode), and every page smaller than the largest
   is padded to it, so all groups share one page size.
2. `group_layers`: layers with equal specs form a type; each type is cut, in layer
   order, into groups of `group_size` = the smallest type's layer count (the last group
   of a type may be smaller). Tensor slot i is shared by layer i of every group.
3. `make_kv_cache_config`: the number of blocks the budget holds, checked against what
   one request of `max_model_len` tokens needs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    round_up,
)

ATTENTION_BLOCK_ALIGN = 16  # tokens: attention kernels want block sizes in multiples of 16
PAGE_ALIGN = 16  # bytes: every view into a page starts on a 16-byte boundary


class KVCacheLayoutError(ValueError):
    """A configuration that cannot be served; raised at start-up with the reason."""


def unify_page_sizes(layer_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Specs with one shared page size (see the module docstring)."""
    if not layer_specs:
        raise KVCacheLayoutError("the model reports no layer with a KV cache")
    # Padding is this function's output: any earlier padding is recomputed.
    specs = {name: replace(s, page_size_padded=None) for name, s in layer_specs.items()}
    mamba = [s for s in specs.values() if isinstance(s, MambaSpec)]
    attention = [s for s in specs.values() if isinstance(s, FullAttentionSpec)]
    if mamba and attention:
        block_size = _aligned_attention_block_size(attention, mamba)
        specs = {name: replace(s, block_size=block_size) for name, s in specs.items()}
    page = round_up(max(s.real_page_size_bytes for s in specs.values()), PAGE_ALIGN)
    return {
        name: s if s.real_page_size_bytes == page else replace(s, page_size_padded=page)
        for name, s in specs.items()
    }


def _aligned_attention_block_size(
    attention: list[FullAttentionSpec], mamba: list[MambaSpec]
) -> int:
    """Smallest block size >= the configured one, a multiple of 16 when raised, whose
    attention pages all hold at least the largest Mamba state."""
    configured = max(s.block_size for s in attention)
    mamba_page = max(s.real_page_size_bytes for s in mamba)
    per_token = min(s.bytes_per_token for s in attention)
    needed = cdiv(mamba_page, per_token)
    if needed <= configured:
        return configured
    return round_up(needed, ATTENTION_BLOCK_ALIGN)


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Split each spec type into equal groups; groups are ordered by their first layer."""
    types: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        types.setdefault(spec, []).append(name)
    group_size = min(len(names) for names in types.values())
    groups = [
        KVCacheGroup(spec, tuple(names[i : i + group_size]))
        for spec, names in types.items()
        for i in range(0, len(names), group_size)
    ]
    order = {name: i for i, name in enumerate(layer_specs)}
    return tuple(sorted(groups, key=lambda g: order[g.layer_names[0]]))


def blocks_needed_for_one_request(group: KVCacheGroup, num_tokens: int) -> int:
    """Real blocks one request of `num_tokens` tokens must hold in this group to make
    progress one token at a time (a longer prefill chunk needs more)."""
    spec = group.spec
    if isinstance(spec, MambaSpec):
        return 2  # the state read (end of the previous block) and the one written
    if isinstance(spec, SlidingWindowSpec):
        window_blocks = cdiv(spec.sliding_window - 1, spec.block_size) + 1
        return min(cdiv(num_tokens, spec.block_size), window_blocks)
    return cdiv(num_tokens, spec.block_size)


def make_kv_cache_config(
    layer_specs: Mapping[str, KVCacheSpec],
    memory_bytes: int,
    max_model_len: int | None = None,
) -> KVCacheConfig:
    """The KV cache for a model whose layers report `layer_specs` (in layer order),
    within `memory_bytes`. Raises KVCacheLayoutError when it cannot work."""
    specs = unify_page_sizes(layer_specs)
    groups = group_layers(specs)
    group_size = max(len(g.layer_names) for g in groups)
    page = groups[0].spec.page_size_bytes
    row_bytes = group_size * page
    num_blocks = memory_bytes // row_bytes
    if num_blocks < 2:
        raise KVCacheLayoutError(
            f"KV cache memory of {memory_bytes} bytes holds {num_blocks} block(s) of "
            f"{row_bytes} bytes ({group_size} layers x {page}-byte pages); at least 2 are "
            f"needed (1 null + 1 usable): raise the KV cache memory"
        )
    if max_model_len is not None:
        _check_fits_one_request(groups, num_blocks, max_model_len, row_bytes)
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def _check_fits_one_request(
    groups: tuple[KVCacheGroup, ...], num_blocks: int, max_model_len: int, row_bytes: int
) -> None:
    if max_model_len <= 0:
        raise KVCacheLayoutError(f"max_model_len must be positive, got {max_model_len}")
    needed = sum(blocks_needed_for_one_request(g, max_model_len) for g in groups)
    if needed > num_blocks - 1:
        raise KVCacheLayoutError(
            f"one request of max_model_len={max_model_len} tokens needs {needed} blocks "
            f"across {len(groups)} KV cache groups, but the KV cache memory holds only "
            f"{num_blocks - 1} usable blocks of {row_bytes} bytes: raise the KV cache "
            f"memory to at least {(needed + 1) * row_bytes} bytes or lower max_model_len"
        )
