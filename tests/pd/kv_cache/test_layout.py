"""From layer specs to a KVCacheConfig: page unification, grouping, block budget, errors."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.kv_cache.layout import (
    KVCacheLayoutError,
    blocks_needed_for_one_request,
    group_layers,
    make_kv_cache_config,
    unify_page_sizes,
)
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

MiB = 1 << 20


def names(*indices: int) -> tuple[str, ...]:
    return tuple(f"layers.{i}" for i in indices)


def mamba_spec(heads: int, head_dim: int, state: int, width: int = 3, ssm_dtype: str = "float32") -> MambaSpec:
    return MambaSpec(block_size=16, num_heads=heads, head_dim=head_dim, state_size=state, n_groups=1,
                     conv_width=width, conv_dtype="bfloat16", ssm_dtype=ssm_dtype)


def attention_spec(cls: type = FullAttentionSpec, **overrides: int) -> FullAttentionSpec:
    fields = {"block_size": 16, "num_kv_heads": 4, "head_size": 64, "dtype": "bfloat16", **overrides}
    return cls(**fields)


def check_config(config: KVCacheConfig, layer_specs: dict[str, KVCacheSpec], memory: int) -> None:
    """What every config must satisfy, whatever the model."""
    grouped = [name for g in config.groups for name in g.layer_names]
    assert sorted(grouped) == sorted(layer_specs), "every layer in exactly one group"
    page = config.page_size_bytes
    assert all(g.spec.page_size_bytes == page for g in config.groups)
    assert page % 16 == 0
    assert config.num_blocks == memory // (config.group_size * page)
    assert len(config.tensors) == config.group_size
    for i, tensor in enumerate(config.tensors):
        assert tensor.size_bytes == config.num_blocks * page
        assert tensor.shared_by == tuple(g.layer_names[i] for g in config.groups if i < len(g.layer_names))
    assert sum(t.size_bytes for t in config.tensors) <= memory
    first_layers = [list(layer_specs).index(g.layer_names[0]) for g in config.groups]
    assert first_layers == sorted(first_layers), "groups ordered by their first layer"


# ---------------------------------------------------------------------------
# Gemma3-like: 22 sliding-window layers, 4 full attention layers
# ---------------------------------------------------------------------------

GEMMA_FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256, dtype="bfloat16")
GEMMA_SLIDING = SlidingWindowSpec(
    block_size=16, num_kv_heads=1, head_size=256, dtype="bfloat16", sliding_window=512
)
GEMMA_PAGE = 2 * 16 * 1 * 256 * 2


def gemma3_specs() -> dict[str, KVCacheSpec]:
    layers = enumerate(names(*range(26)))
    return {name: GEMMA_FULL if (i + 1) % 6 == 0 else GEMMA_SLIDING for i, name in layers}


def test_gemma3_groups_and_tensors() -> None:
    specs = gemma3_specs()
    memory = 100 * 4 * GEMMA_PAGE + 123
    config = make_kv_cache_config(specs, memory)
    check_config(config, specs, memory)
    assert config.group_size == 4 and config.num_blocks == 100
    assert [g.layer_names for g in config.groups] == [
        names(0, 1, 2, 3),
        names(4, 6, 7, 8),
        names(5, 11, 17, 23),
        names(9, 10, 12, 13),
        names(14, 15, 16, 18),
        names(19, 20, 21, 22),
        names(24, 25),
    ]
    assert [g.spec for g in config.groups] == [GEMMA_SLIDING] * 2 + [GEMMA_FULL] + [GEMMA_SLIDING] * 4
    assert config.page_size_bytes == GEMMA_PAGE
    assert all(g.spec.page_size_padded is None for g in config.groups), "equal pages need no padding"
    assert config.tensors[0].shared_by == names(0, 4, 5, 9, 14, 19, 24)
    assert config.tensors[3].shared_by == names(3, 8, 23, 13, 18, 22)
    assert config.layer_slot("layers.17") == (2, 2)
    assert config.layer_slot("layers.25") == (6, 1)


def test_gemma3_max_model_len_boundary() -> None:
    specs = gemma3_specs()
    row = 4 * GEMMA_PAGE
    max_len = 4096
    # full: 4096/16 = 256 blocks; each of 6 sliding groups: cdiv(511, 16) + 1 = 33
    needed = 256 + 6 * 33
    config = make_kv_cache_config(specs, (needed + 1) * row, max_model_len=max_len)
    assert config.num_blocks == needed + 1
    with pytest.raises(KVCacheLayoutError) as error:
        make_kv_cache_config(specs, (needed + 1) * row - 1, max_model_len=max_len)
    message = str(error.value)
    assert "max_model_len=4096" in message
    assert "raise the KV cache memory" in message
    assert f"at least {(needed + 1) * row} bytes" in message


# ---------------------------------------------------------------------------
# Bamba-like: Mamba2 layers with two attention layers
# ---------------------------------------------------------------------------

BAMBA_ATTENTION = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
BAMBA_MAMBA = mamba_spec(16, 64, 64)


def bamba_specs() -> dict[str, KVCacheSpec]:
    return {name: BAMBA_ATTENTION if i in (2, 6) else BAMBA_MAMBA for i, name in enumerate(names(*range(8)))}


def test_bamba_attention_block_size_is_raised_to_hold_the_mamba_state() -> None:
    mamba_page = 2 * 64 * 3 * 2 + 16 * (64 * 64 * 4 + 64 * 3 * 2)  # B and C, then 16 heads: SSM + x conv
    assert BAMBA_MAMBA.real_page_size_bytes == mamba_page
    per_token = 2 * 2 * 64 * 4
    expected = 16 * -(-mamba_page // (16 * per_token))  # smallest multiple of 16 that fits
    assert expected == 272
    assert expected * per_token >= mamba_page > (expected - 16) * per_token

    unified = unify_page_sizes(bamba_specs())
    attention, mamba = unified["layers.2"], unified["layers.0"]
    assert attention.block_size == mamba.block_size == expected
    assert attention.page_size_bytes == attention.real_page_size_bytes == expected * per_token
    assert mamba.page_size_padded == attention.page_size_bytes
    assert mamba.real_page_size_bytes == mamba_page < mamba.page_size_bytes
    assert len({s.page_size_bytes for s in unified.values()}) == 1


def test_bamba_groups() -> None:
    specs = bamba_specs()
    page = 272 * 2 * 2 * 64 * 4
    memory = 10 * 2 * page + 1
    config = make_kv_cache_config(specs, memory)
    check_config(config, specs, memory)
    assert config.page_size_bytes == page and config.group_size == 2 and config.num_blocks == 10
    assert [g.layer_names for g in config.groups] == [names(0, 1), names(2, 6), names(3, 4), names(5, 7)]
    assert [type(g.spec) for g in config.groups] == [MambaSpec, FullAttentionSpec, MambaSpec, MambaSpec]
    assert config.block_sizes == [272] * 4
    assert config.tensors[0].shared_by == names(0, 2, 3, 5)
    assert config.tensors[1].shared_by == names(1, 6, 4, 7)


def test_unify_page_sizes_is_idempotent() -> None:
    for specs in (bamba_specs(), gemma3_specs()):
        once = unify_page_sizes(specs)
        assert unify_page_sizes(once) == once


# ---------------------------------------------------------------------------
# Four types of two layers each
# ---------------------------------------------------------------------------


SMALL_MAMBA = mamba_spec(4, 32, 16)  # 192 + 4 * (2048 + 192) bytes: fits a 16-token page of 16384
FOUR_TYPES = [
    attention_spec(),
    attention_spec(SlidingWindowSpec, sliding_window=128),
    attention_spec(SlidingWindowSpec, sliding_window=1024),
    SMALL_MAMBA,
]


def test_four_types_of_two_layers_give_four_groups_and_keep_the_block_size() -> None:
    specs = {name: FOUR_TYPES[i % 4] for i, name in enumerate(names(*range(8)))}
    page = 16 * 2 * 4 * 64 * 2
    memory = 7 * 2 * page
    config = make_kv_cache_config(specs, memory, max_model_len=16)
    check_config(config, specs, memory)
    assert config.num_blocks == 7 and config.group_size == 2
    assert [g.layer_names for g in config.groups] == [names(0, 4), names(1, 5), names(2, 6), names(3, 7)]
    assert config.block_sizes == [16] * 4
    assert config.page_size_bytes == page
    assert config.groups[3].spec.page_size_padded == page
    assert config.groups[3].spec.real_page_size_bytes == 192 + 4 * (2048 + 192)
    assert [g.spec.page_size_padded for g in config.groups[:3]] == [None] * 3


def test_a_configured_block_size_big_enough_for_mamba_is_kept() -> None:
    attention = FullAttentionSpec(block_size=320, num_kv_heads=2, head_size=64, dtype="float32")
    assert attention.real_page_size_bytes >= BAMBA_MAMBA.real_page_size_bytes
    unified = unify_page_sizes({"a": attention, "m": BAMBA_MAMBA})
    assert unified["a"].block_size == unified["m"].block_size == 320
    assert unified["a"].page_size_padded is None


def test_attention_only_models_keep_their_block_size() -> None:
    specs = gemma3_specs()
    assert unify_page_sizes(specs) == specs
    odd = {"a": FullAttentionSpec(block_size=24, num_kv_heads=1, head_size=64, dtype="float16")}
    assert unify_page_sizes(odd)["a"].block_size == 24


def test_differing_attention_pages_are_padded_to_the_largest() -> None:
    small = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    large = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype="bfloat16")
    specs = {"l0": small, "l1": large, "l2": small, "l3": large}
    config = make_kv_cache_config(specs, 3 * 2 * large.real_page_size_bytes)
    check_config(config, specs, 3 * 2 * large.real_page_size_bytes)
    assert config.page_size_bytes == large.real_page_size_bytes == 2 * small.real_page_size_bytes
    assert [g.layer_names for g in config.groups] == [("l0", "l2"), ("l1", "l3")]
    assert config.groups[0].spec.page_size_padded == large.real_page_size_bytes
    assert config.groups[0].spec.block_size == config.groups[1].spec.block_size == 16


def test_mamba_only_page_is_rounded_to_16_bytes() -> None:
    mamba = mamba_spec(1, 1, 3, width=5)  # B and C: 60 bytes; the head: 12 of SSM, 10 of x conv aligned to 12
    assert mamba.group_shared_bytes == 60 and mamba.head_page_bytes == 24 and mamba.real_page_size_bytes == 84
    config = make_kv_cache_config({"m0": mamba, "m1": mamba}, 10 * 2 * 96)
    assert config.page_size_bytes == 96 and config.num_blocks == 10 and config.group_size == 2


def test_group_layers_cuts_each_type_in_layer_order() -> None:
    a, b = attention_spec(), SMALL_MAMBA
    groups = group_layers({"x0": b, "x1": a, "x2": b, "x3": b, "x4": a, "x5": b, "x6": b})
    assert [(g.spec, g.layer_names) for g in groups] == [
        (b, ("x0", "x2")),
        (a, ("x1", "x4")),
        (b, ("x3", "x5")),
        (b, ("x6",)),
    ]


# ---------------------------------------------------------------------------
# Blocks one request needs
# ---------------------------------------------------------------------------


def test_blocks_needed_for_one_request_per_type() -> None:
    full, sliding_128, sliding_1024, mamba = (KVCacheGroup(s, ("l",)) for s in FOUR_TYPES)
    assert [blocks_needed_for_one_request(full, n) for n in (1, 16, 17, 1000)] == [1, 1, 2, 63]
    assert [blocks_needed_for_one_request(sliding_128, n) for n in (1, 16, 17, 1000)] == [1, 1, 2, 9]
    assert blocks_needed_for_one_request(sliding_1024, 1000) == 63
    assert blocks_needed_for_one_request(sliding_1024, 10_000) == 65
    assert blocks_needed_for_one_request(mamba, 1) == blocks_needed_for_one_request(mamba, 10_000) == 2


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 40), block_size=st.integers(1, 12), num_tokens=st.integers(1, 80))
def test_sliding_window_blocks_needed_matches_brute_force(
    window: int, block_size: int, num_tokens: int
) -> None:
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=window
    )
    # Token p attends to tokens max(0, p - window + 1) .. p: count the blocks those span.
    worst = max(p // block_size - max(0, p - window + 1) // block_size + 1 for p in range(num_tokens))
    assert blocks_needed_for_one_request(KVCacheGroup(spec, ("l",)), num_tokens) == worst


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_no_layers_is_an_error() -> None:
    with pytest.raises(KVCacheLayoutError, match="no layer"):
        make_kv_cache_config({}, MiB)


def test_memory_for_fewer_than_two_blocks_is_an_error() -> None:
    specs = gemma3_specs()
    row = 4 * GEMMA_PAGE
    assert make_kv_cache_config(specs, 2 * row).num_blocks == 2
    with pytest.raises(KVCacheLayoutError) as error:
        make_kv_cache_config(specs, 2 * row - 1)
    assert f"{2 * row - 1} bytes" in str(error.value)
    assert "raise the KV cache memory" in str(error.value)


def test_max_model_len_must_be_positive() -> None:
    with pytest.raises(KVCacheLayoutError, match="max_model_len"):
        make_kv_cache_config(gemma3_specs(), 100 * MiB, max_model_len=0)


def test_layout_errors_are_value_errors() -> None:
    assert issubclass(KVCacheLayoutError, ValueError)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FullAttentionSpec(block_size=0, num_kv_heads=1, head_size=8, dtype="float16"), "block_size"),
        (lambda: attention_spec(SlidingWindowSpec, sliding_window=0), "sliding_window"),
        (lambda: FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float13"), "float13"),
        (lambda: attention_spec(num_kv_heads=0), "num_kv_heads"),
        (lambda: mamba_spec(3, 0, 2), "dimensions"),
        (lambda: mamba_spec(3, 1, 2, ssm_dtype="int4"), "int4"),
        (lambda: MambaSpec(block_size=16, num_heads=3, head_dim=1, state_size=2, n_groups=2, conv_width=3,
                           conv_dtype="float32", ssm_dtype="float32"), "do not split"),
        (lambda: attention_spec(page_size_padded=100), "page_size_padded"),
        (lambda: KVCacheGroup(attention_spec(), ()), "at least one layer"),
    ],
)
def test_invalid_specs_are_rejected(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_config_with_unequal_page_sizes_is_rejected() -> None:
    small = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float16")
    groups = (KVCacheGroup(small, ("a",)), KVCacheGroup(attention_spec(), ("b",)))
    with pytest.raises(ValueError, match="one page size"):
        KVCacheConfig(num_blocks=4, groups=groups)


def test_config_needs_a_group_two_blocks_and_distinct_layers() -> None:
    spec = attention_spec()
    with pytest.raises(ValueError, match="at least one group"):
        KVCacheConfig(num_blocks=4, groups=())
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(num_blocks=1, groups=(KVCacheGroup(spec, ("a",)),))
    with pytest.raises(ValueError, match="more than one KV cache group"):
        KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(spec, ("a", "b")), KVCacheGroup(spec, ("b",))))


# ---------------------------------------------------------------------------
# Random hybrid models
# ---------------------------------------------------------------------------

DTYPES = st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"])
ATTENTION_SPECS = st.builds(
    FullAttentionSpec,
    block_size=st.sampled_from([1, 8, 16, 24, 64]),
    num_kv_heads=st.integers(1, 4),
    head_size=st.sampled_from([8, 64, 80]),
    dtype=DTYPES,
)
MAMBA_SPECS = st.builds(
    MambaSpec,
    block_size=st.just(16),
    num_heads=st.integers(1, 8),
    head_dim=st.integers(1, 64),
    state_size=st.integers(1, 64),
    n_groups=st.just(1),
    conv_width=st.integers(1, 4),
    conv_dtype=DTYPES,
    ssm_dtype=DTYPES,
)


@settings(max_examples=200, deadline=None)
@given(
    attention=st.lists(ATTENTION_SPECS, min_size=1, max_size=3),
    mamba=st.lists(MAMBA_SPECS, min_size=1, max_size=3),
)
def test_hybrid_pages_are_unified_with_the_smallest_aligned_block_size(
    attention: list[FullAttentionSpec], mamba: list[MambaSpec]
) -> None:
    specs = {f"l{i}": s for i, s in enumerate(attention + mamba)}
    unified = unify_page_sizes(specs)
    pages = {s.page_size_bytes for s in unified.values()}
    assert len(pages) == 1 and pages.pop() % 16 == 0
    block_size = unified["l0"].block_size
    assert {s.block_size for s in unified.values()} == {block_size}
    configured = max(s.block_size for s in attention)
    largest_mamba = max(s.real_page_size_bytes for s in mamba)
    per_token = min(s.bytes_per_token for s in attention)
    assert block_size * per_token >= largest_mamba
    if block_size != configured:
        assert block_size > configured and block_size % 16 == 0
        assert (block_size - 16) * per_token < largest_mamba
    for name, spec in unified.items():
        assert (spec.page_size_padded is None) == (spec.real_page_size_bytes == spec.page_size_bytes)
        # unification changes nothing but the block size and the padding
        assert with_block_size(specs[name], block_size) == with_block_size(spec, block_size)


def with_block_size(spec: KVCacheSpec, block_size: int) -> KVCacheSpec:
    return dataclasses.replace(spec, block_size=block_size, page_size_padded=None)


def test_padding_given_on_input_specs_is_recomputed() -> None:
    # Equal layers, one carrying a stale padding, are one type with the real page.
    plain = attention_spec()
    stale = dataclasses.replace(plain, page_size_padded=2 * plain.real_page_size_bytes)
    config = make_kv_cache_config({"a": plain, "b": stale}, 100 * plain.real_page_size_bytes)
    assert len(config.groups) == 1 and config.page_size_bytes == plain.real_page_size_bytes
