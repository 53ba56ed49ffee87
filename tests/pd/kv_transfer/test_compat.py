"""The compatibility hash: stable across processes and versions, and different when
anything that decides what a block's bytes mean differs."""

from __future__ import annotations

from pd.kv_transfer.compat import compat_hash

HASH_ARGS = dict(model_id="tiny-qwen3", weights="0f" * 16, quantization="none", dtype="bfloat16",
                 block_sizes=[16, 16], layout="canonical",
                 group_specs_repr=["FullAttentionSpec(block_size=16)", "SlidingWindowSpec(window=8)"])


def test_compat_hash_is_stable_and_sees_every_input() -> None:
    h = compat_hash(**HASH_ARGS)
    assert len(h) == 64 and int(h, 16) >= 0
    # Pinned: the hash is compared across processes and versions; changing what it covers
    # must be deliberate (bump _COMPAT_VERSION) and will show here.
    assert h == PINNED_HASH
    assert compat_hash(**(HASH_ARGS | {"block_sizes": (16, 16)})) == h  # tuple or list alike
    changes = [
        {"model_id": "tiny-qwen3b"},
        {"weights": "1f" * 16},
        {"quantization": "int8"},
        {"dtype": "float16"},
        {"block_sizes": [16, 32]},
        {"layout": "per-layer"},
        {"group_specs_repr": list(reversed(HASH_ARGS["group_specs_repr"]))},
        {"group_specs_repr": HASH_ARGS["group_specs_repr"][:1]},
    ]
    hashes = {compat_hash(**(HASH_ARGS | change)) for change in changes}
    assert len(hashes) == len(changes) and h not in hashes


def test_compat_hash_does_not_confuse_field_boundaries() -> None:
    a = compat_hash("model", "w", "none", "float16", [16], "canonical", ["ab", "c"])
    b = compat_hash("model", "w", "none", "float16", [16], "canonical", ["a", "bc"])
    c = compat_hash("modelf", "w", "none", "loat16", [16], "canonical", ["ab", "c"])
    assert len({a, b, c}) == 3


PINNED_HASH = "66e2fac31b3ff2eee908a80058a25e0a9accdd25c7a876e603d242879bd6c386"
