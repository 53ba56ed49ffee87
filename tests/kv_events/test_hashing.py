"""Chained block hashes: prefix semantics, salts, incremental extension, stability."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_events.hashing as hashing
from kv_events.hashing import extend_block_hashes, hash_block_tokens
from pd.contracts.request import Request

BLOCK_SIZE = 4
TOKENS = list(range(100, 123))  # 23 tokens: 5 full blocks of 4 and 3 left over


def hashes_of(tokens: list[int], block_size: int = BLOCK_SIZE, salt: str | None = None) -> list[bytes]:
    return Request("r", list(tokens), cache_salt=salt).block_hashes(block_size)


def test_only_full_blocks_are_hashed() -> None:
    for n in range(1, len(TOKENS) + 1):
        assert len(hashes_of(TOKENS[:n])) == n // BLOCK_SIZE


def test_digests_are_at_least_128_bits() -> None:
    assert all(isinstance(h, bytes) and len(h) >= 16 for h in hashes_of(TOKENS))
    assert len(hash_block_tokens(None, [1, 2, 3])) >= 16


def test_equal_prefixes_give_equal_hashes() -> None:
    other = TOKENS[:12] + [0] * 11  # same first 3 blocks, different afterwards
    a, b = hashes_of(TOKENS), hashes_of(other)
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:]))


@pytest.mark.parametrize("position", [0, 3, 9])
def test_changing_a_token_changes_its_block_and_every_later_hash(position: int) -> None:
    changed = list(TOKENS)
    changed[position] += 1
    a, b = hashes_of(TOKENS), hashes_of(changed)
    block = position // BLOCK_SIZE
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:]))


def test_hash_depends_on_the_parent_not_only_the_tokens() -> None:
    repeated = [5, 6, 7, 8] * 3  # three blocks of identical tokens
    hashes = hashes_of(repeated)
    assert len(set(hashes)) == 3


def test_cache_salt_changes_every_hash_from_block_zero() -> None:
    plain, salted, other = hashes_of(TOKENS), hashes_of(TOKENS, salt="a"), hashes_of(TOKENS, salt="b")
    assert all(x != y for x, y in zip(plain, salted))
    assert all(x != y for x, y in zip(salted, other))
    assert hashes_of(TOKENS, salt="a") == salted


def test_extra_is_not_confused_with_tokens() -> None:
    # Length prefixes keep (tokens, extra) pairs that concatenate alike apart.
    assert hash_block_tokens(None, [1, 2], b"") != hash_block_tokens(None, [1], b"\x02" + b"\x00" * 7)
    assert hash_block_tokens(None, [1], b"x") != hash_block_tokens(None, [1], b"")


def test_block_sizes_give_independent_lists() -> None:
    request = Request("r", list(TOKENS))
    by_4, by_8 = request.block_hashes(4), request.block_hashes(8)
    assert len(by_4) == 5 and len(by_8) == 2
    assert by_4 == hashes_of(TOKENS, 4) and by_8 == hashes_of(TOKENS, 8)
    assert not set(by_4) & set(by_8)
    request.append_output_token_ids(1)
    assert len(request.block_hashes(4)) == 6 and len(request.block_hashes(8)) == 3


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
    output=st.lists(st.integers(0, 2**31), max_size=30),
    block_size=st.integers(1, 6),
    salt=st.sampled_from([None, "s"]),
)
def test_incremental_hashes_equal_one_shot_hashes(
    prompt: list[int], output: list[int], block_size: int, salt: str | None
) -> None:
    request = Request("r", list(prompt), cache_salt=salt)
    for token in output:
        request.block_hashes(block_size)
        request.append_output_token_ids(token)
    assert request.block_hashes(block_size) == hashes_of(prompt + output, block_size, salt)


def test_extension_hashes_each_full_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hashing.hash_block_tokens

    def counting(parent, token_ids, extra=b""):
        calls.append(list(token_ids))
        return real(parent, token_ids, extra)

    monkeypatch.setattr(hashing, "hash_block_tokens", counting)
    request = Request("r", [1, 2, 3])
    for token in range(4, 30):
        request.block_hashes(BLOCK_SIZE)
        request.append_output_token_ids(token)
    hashes = request.block_hashes(BLOCK_SIZE)
    assert len(hashes) == 29 // BLOCK_SIZE
    assert len(calls) == len(hashes)
    assert calls == [list(range(i, i + BLOCK_SIZE)) for i in range(1, 29, BLOCK_SIZE)]


def test_extend_block_hashes_appends_to_the_given_list() -> None:
    hashes: list[bytes] = []
    assert extend_block_hashes(hashes, TOKENS[:8], BLOCK_SIZE) is hashes
    assert len(hashes) == 2
    extend_block_hashes(hashes, TOKENS, BLOCK_SIZE)
    assert hashes == hashes_of(TOKENS)


_CHILD = (
    "from pd.contracts.request import Request; "
    "print(' '.join(h.hex() for h in Request('r', list(range(100, 123)), cache_salt='s').block_hashes(4)))"
)


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_hashes_are_stable_across_processes(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [h.hex() for h in hashes_of(TOKENS, salt="s")]
