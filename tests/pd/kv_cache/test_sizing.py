"""`--kv-cache-memory auto`: a quarter of the memory available less the weights on a CPU,
bounded, split among ranks; $PD_KV_CACHE_MEMORY replaces it; a small model's blocks capped
in tokens."""

from __future__ import annotations

import pytest

from pd.config import EngineConfig
from pd.engine.core import EngineCore
from pd.kv_cache import sizing
from pd.models.make_model import make_model

GIB = 1024 ** 3


@pytest.fixture
def model(tmp_path):
    return make_model("qwen3", tmp_path / "q", seed=1)


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(sizing.ENV, raising=False)
    return monkeypatch


def test_a_cpu_takes_a_quarter_of_what_is_available_after_the_weights(model, unpinned) -> None:
    unpinned.setattr(sizing, "memory_available", lambda: 16 * GIB)
    weights = sizing.weight_bytes(model)
    assert weights > 0
    size, why = sizing.auto_kv_cache_memory(model, lambda: "cpu", 1)
    assert size == int(0.25 * (16 * GIB - weights))
    assert "25% of 16.0 GiB available" in why
    assert sizing.auto_kv_cache_memory(model, lambda: "cpu", 4)[0] == int(0.25 * (16 * GIB - weights) / 4)


@pytest.mark.parametrize("available, expected", [(0, sizing.MIN_BYTES), (1024 * GIB, sizing.MAX_BYTES)])
def test_the_size_is_bounded(model, unpinned, available, expected) -> None:
    unpinned.setattr(sizing, "memory_available", lambda: available)
    assert sizing.auto_kv_cache_memory(model, lambda: "cpu", 1)[0] == expected


def test_the_environment_replaces_auto_and_a_bad_value_is_refused(model, monkeypatch) -> None:
    monkeypatch.setenv(sizing.ENV, "123456789")
    cache = EngineConfig.from_flat(model=model).resolve().cache
    assert cache.memory == 123456789 and "PD_KV_CACHE_MEMORY" in cache.memory_reason
    monkeypatch.setenv(sizing.ENV, "lots")
    with pytest.raises(ValueError, match="number of bytes"):
        EngineConfig.from_flat(model=model).resolve()
    assert EngineConfig.from_flat(model=model, kv_cache_memory=5_000_000).resolve().cache.memory_reason == "as asked"
    with pytest.raises(ValueError, match="bytes or auto"):
        EngineConfig.from_flat(model=model, kv_cache_memory="big")


def test_an_automatic_size_keeps_a_small_model_s_blocks_to_the_token_cap(model, unpinned) -> None:
    """8 GiB for a tiny model would be millions of blocks; auto keeps MAX_TOKENS of them
    (here lowered), an explicit size is taken as given."""
    unpinned.setattr(sizing, "memory_available", lambda: 32 * GIB)
    unpinned.setattr(sizing, "MAX_TOKENS", 4096)
    config = EngineConfig.from_flat(model=model, max_model_len=256).resolve()
    assert config.cache.memory >= GIB and config.cache.max_tokens == 4096
    core = EngineCore(config)
    try:
        blocks = core.info().num_blocks
        assert 0 < blocks * config.cache.block_size <= 4096
        assert blocks * config.cache.block_size > 4096 // 2
    finally:
        core.shutdown()
