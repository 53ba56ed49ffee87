"""ModelRunner: attention groups per (KV cache group, backend, window), metadata built once
per attention group per step and shared by its layers, block tables per group."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.models.make_model import make_model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return make_model("gemma3", tmp_path_factory.mktemp("m") / "gemma3", seed=0)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory) -> Path:
    return make_model("bamba", tmp_path_factory.mktemp("m") / "bamba", seed=0)


def record_builds(runner) -> list[tuple[int, dict]]:
    """Wrap every builder to count its calls; returns the log of built metadata per step."""
    calls: list[tuple[int, dict]] = []
    for group in runner.attention_groups:
        build = group.builder.build

        def counted(common, _build=build, _group=group):
            calls.append((id(_group), common))
            return _build(common)

        group.builder.build = counted
    return calls


def step_once(llm: LLM, prompt_len: int) -> dict[str, object]:
    engine = llm.engine
    engine.add_request(Request("r", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=2)))
    built = {}
    original = engine.runner._build_metadata

    def capture(common):
        built.update(original(common))
        return built

    engine.runner._build_metadata = capture
    engine.step()
    return built


@pytest.mark.parametrize("hybrid", [True, False])
def test_gemma3_metadata_is_built_once_per_attention_group_and_shared(gemma3: Path, hybrid: bool) -> None:
    llm = LLM(str(gemma3), hybrid_kv_cache=hybrid, kv_cache_memory=16 << 20, max_model_len=512)
    runner = llm.engine.runner
    groups = runner.attention_groups
    if hybrid:  # 3 KV cache groups (sliding x2, full), one attention group each
        assert len(llm.engine.kv_cache_config.groups) == 3 and len(groups) == 3
    else:  # 1 KV cache group holding two attention groups: full and window 128
        assert len(llm.engine.kv_cache_config.groups) == 1
        assert sorted((g.kv_cache_group_id, g.sliding_window or 0) for g in groups) == [(0, 0), (0, 128)]
    calls = record_builds(runner)
    metadata = step_once(llm, 40)
    assert sorted(c[0] for c in calls) == sorted(id(g) for g in groups)  # each built once
    for group in groups:
        shared = {id(metadata[name]) for name in group.layer_names}
        assert len(shared) == 1
        assert metadata[group.layer_names[0]].sliding_window == group.sliding_window
    assert len({id(m) for m in metadata.values()}) == len(groups)


def test_bamba_has_mamba_and_attention_groups_with_their_own_block_tables(bamba: Path) -> None:
    llm = LLM(str(bamba), kv_cache_memory=16 << 20)
    config = llm.engine.kv_cache_config
    runner = llm.engine.runner
    backends = sorted(g.backend for g in runner.attention_groups)
    assert backends == ["mamba", "mamba", "torch"]
    assert len(runner.block_tables) == len(config.groups)
    metadata = step_once(llm, 300)  # > 2 blocks of 144 tokens: boundary states are written
    mamba_meta = metadata["layers.0"]
    (prefill,) = mamba_meta.prefills
    ids = llm.engine.kv_cache_manager.get_block_ids("r")
    mamba_group = config.layer_slot("layers.0")[0]
    assert [block for _, block in prefill.writes] == ids[mamba_group][:3]
    assert metadata["layers.1"] is mamba_meta  # layers 0 and 1 share a Mamba group
