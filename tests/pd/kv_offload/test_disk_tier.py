"""The disk tier inside a real engine (pd.LLM, tiny checkpoints of every family): a KV
cache far too small for the prompts, so their blocks leave it and come back from disk.
Tokens equal a cold computation; what the tier holds survives a restart under the same
compatibility hash and not under another; a corrupt block is a miss, never KV."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.contracts.sampling_params import SamplingParams
from pd.kv_offload import disk
from pd.llm import LLM
from pd.models.make_model import make_model
from tests.support.server_harness import ARCHS

# bytes of KV cache holding one 512-token request and little more, per family
SMALL_CACHE = {"qwen3": 2_400_000, "gemma3": 2_400_000, "bamba": 3_600_000, "granitehybrid": 3_600_000}
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


def prompts(seed: int = 0, count: int = 8, length: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def cold(tiny_models) -> dict[str, list[list[int]]]:
    """Each family's tokens for `prompts()`, computed with a cache that holds them all and no tier."""
    out = {}
    for arch in ARCHS:
        with LLM(str(tiny_models[arch]), max_model_len=512, num_threads=1) as llm:
            out[arch] = [o.token_ids for o in llm.generate(prompts(), PARAMS)]
    return out


def tiered(model: Path, arch: str, directory: Path, **overrides) -> LLM:
    args = dict(max_model_len=512, num_threads=1, kv_cache_memory=SMALL_CACHE[arch],
                kv_offload_disk_path=directory, kv_offload_disk_bytes=64 << 20) | overrides
    return LLM(str(model), **args)


def one_by_one(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, so the ones before it have pushed its blocks out of the KV cache."""
    tokens = []
    for prompt in batch:
        tokens += [o.token_ids for o in llm.generate([prompt], PARAMS)]
        llm.engine.kv_cache_manager.check_integrity()
    return tokens


def from_disk(llm: LLM) -> int:
    return llm.engine.scheduler.prompt_sources.counts.get("disk", 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_whose_blocks_left_the_cache_load_them_from_disk_and_answer_as_computed(
        arch, tiny_models, cold, tmp_path):
    with tiered(tiny_models[arch], arch, tmp_path) as llm:
        assert llm.engine.kv_cache_config.num_blocks * 16 < 8 * 200  # the cache cannot hold the prompts
        assert one_by_one(llm, prompts()) == cold[arch]
        assert from_disk(llm) == 0
        assert one_by_one(llm, prompts()) == cold[arch]
        # every prompt but its last, unfull block (and the token always computed) came from disk
        block = max(llm.engine.kv_cache_config.block_sizes)
        assert from_disk(llm) == 8 * (199 // block * block)
        tier = llm.engine.runner.connector.tiers["disk"]
        assert tier.counters["loaded_blocks"] > 0 and tier.counters["corrupt_blocks"] == 0
        assert llm.engine.kv_cache_manager.pinned == {} and llm.engine.kv_cache_manager.usage == 0.0


def test_a_restarted_engine_loads_what_the_last_one_left_on_disk(tiny_models, cold, tmp_path):
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path) as llm:
        one_by_one(llm, prompts())
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path) as llm:
        assert one_by_one(llm, prompts()) == cold["qwen3"]
        assert from_disk(llm) == 8 * 192


@pytest.mark.parametrize("change", ["block size", "weights", "quantization"])
def test_a_tier_written_under_another_compatibility_hash_starts_empty(change, tiny_models, cold, tmp_path, caplog):
    """Another block size, other weights of the same architecture (another seed), or
    linears computed otherwise (int8): the KV the last engine left means something else."""
    model, before = tiny_models["qwen3"], {}
    if change == "block size":
        before = {"block_size": 32}
    elif change == "weights":
        model = make_model("qwen3", tmp_path / "other-weights", seed=7)
    else:
        before = {"quantization": "int8"}
    with tiered(model, "qwen3", tmp_path / "tier", **before) as llm:
        one_by_one(llm, prompts())
        assert llm.engine.runner.connector.tiers["disk"].entries
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path / "tier") as llm:
        assert "another compatibility hash" in caplog.text
        assert not llm.engine.runner.connector.tiers["disk"].entries
        assert one_by_one(llm, prompts()) == cold["qwen3"]
        assert from_disk(llm) == 0


def test_a_torn_index_starts_the_tier_empty_with_a_log_line(tiny_models, cold, tmp_path, caplog):
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path) as llm:
        one_by_one(llm, prompts())
    index = tmp_path / "pd-kv.index"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])  # a write cut short
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path) as llm:
        assert "is unreadable" in caplog.text and not llm.engine.runner.connector.tiers["disk"].entries
        assert one_by_one(llm, prompts()) == cold["qwen3"]
        assert from_disk(llm) == 0


def test_a_corrupt_block_on_disk_is_a_miss_and_the_tier_goes_on(tiny_models, cold, tmp_path):
    with tiered(tiny_models["gemma3"], "gemma3", tmp_path) as llm:
        one_by_one(llm, prompts())
        tier = llm.engine.runner.connector.tiers["disk"]
        with open(tier.data_path, "r+b") as f:  # one byte of every slot that holds a block
            for slot in list(tier.entries):
                f.seek(slot * tier.slot_bytes + 7)
                byte = f.read(1)
                f.seek(slot * tier.slot_bytes + 7)
                f.write(bytes([byte[0] ^ 0xFF]))
        assert one_by_one(llm, prompts()) == cold["gemma3"]
        assert tier.counters["corrupt_blocks"] > 0 and tier.off_reason is None
        assert llm.engine.scheduler.remote_kv.load_failures["recompute"] > 0
        assert one_by_one(llm, prompts()) == cold["gemma3"]  # stored again, loaded again
        assert from_disk(llm) > 0 and llm.engine.kv_cache_manager.usage == 0.0


def test_a_second_engine_on_the_same_directory_serves_without_a_tier(tiny_models, cold, tmp_path, caplog):
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path), \
            tiered(tiny_models["qwen3"], "qwen3", tmp_path) as second:
        assert "another server's disk tier uses this directory" in caplog.text
        assert second.engine.runner.connector.tiers["disk"].off_reason is not None
        assert one_by_one(second, prompts()) == cold["qwen3"]


def hosted(model: Path, arch: str, **overrides) -> LLM:
    args = dict(max_model_len=512, num_threads=1, kv_cache_memory=SMALL_CACHE[arch],
                kv_offload_host_bytes=64 << 20) | overrides
    return LLM(str(model), **args)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_whose_blocks_left_the_cache_load_them_from_host_memory(arch, tiny_models, cold):
    with hosted(tiny_models[arch], arch) as llm:
        assert one_by_one(llm, prompts()) == cold[arch]
        assert one_by_one(llm, prompts()) == cold[arch]
        block = max(llm.engine.kv_cache_config.block_sizes)
        assert llm.engine.scheduler.prompt_sources.counts.get("host", 0) == 8 * (199 // block * block)
        assert llm.engine.kv_cache_manager.pinned == {} and llm.engine.kv_cache_manager.usage == 0.0


def test_a_prompt_split_between_host_and_disk_reads_each_block_from_the_fastest_holding_it(tiny_models, cold,
                                                                                          tmp_path):
    batch = prompts()
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path, kv_offload_host_bytes=6 * 65536) as llm:
        one_by_one(llm, batch)  # the host tier holds the last 6 blocks stored: the second half of the last prompt
        assert llm.engine.kv_cache_manager.reset_prefix_cache()  # the device forgets: the tiers keep theirs
        tiers = llm.engine.runner.connector.tiers
        assert one_by_one(llm, batch[-1:]) == cold["qwen3"][-1:]
        assert tiers["host"].counters["loaded_blocks"] == 6 and tiers["disk"].counters["loaded_blocks"] == 6
        assert from_disk(llm) == 192  # counted as from the slowest tier it read
        assert one_by_one(llm, batch) == cold["qwen3"]
        assert llm.engine.kv_cache_manager.pinned == {} and llm.engine.kv_cache_manager.usage == 0.0


def test_a_host_tier_whose_copy_fails_turns_itself_off_and_fails_its_loads(tiny_models):
    from pd.kv_offload.host import HostTier
    from pd.kv_offload.tier import TierBlock

    with LLM(str(tiny_models["qwen3"]), max_model_len=512, num_threads=1, kv_cache_memory=SMALL_CACHE["qwen3"]) as llm:
        tier = HostTier(1 << 20, llm.engine.runner.kv_allocation.describe(None))
        try:
            tier.load("r", [TierBlock(0, 0, 10**6, b"h" * 32)])  # no such block: the copy raises
            while tier.busy and not (ended := tier.poll()).load_failed:
                pass
            assert "r" in ended.load_failed and tier.off_reason is not None
            tier.store([TierBlock(1, 0, 1, b"g" * 32)])
            assert tier.poll().store_failed == [(b"g" * 32, 0)]  # off: nothing more is stored
        finally:
            tier.shutdown()


def test_a_staged_disk_tier_moves_blocks_through_host_rows_as_a_gpu_engines_does(tiny_models, tmp_path):
    """A GPU engine's disk tier copies each block to a host row before its write and back
    after its read (NIXL's POSIX backend moves host memory); forced here on the CPU, the
    same code: a block written, wiped in the KV cache, read back equal, every row free."""
    import torch

    from pd.kv_offload.disk import DiskTier
    from pd.kv_offload.tier import TierBlock

    with LLM(str(tiny_models["gemma3"]), max_model_len=512, num_threads=1,
             kv_cache_memory=SMALL_CACHE["gemma3"]) as llm:
        caches = llm.engine.runner.kv_allocation.describe(None)
        tier = DiskTier(tmp_path, 1 << 24, caches, "hash", "pd-test-staged", staged=True)
        try:
            assert tier.off_reason is None and tier.staging is not None
            kv = caches.tensors[0].tensor
            blocks = [TierBlock(slot, group, 3 + group, bytes([group]) * 32) for slot, group in ((7, 0), (2, 1))]
            kv[3:5] = torch.randint(-128, 128, kv[3:5].shape, dtype=torch.int8)
            written = kv[3:5].clone()
            tier.store(blocks)
            assert wait_for(tier, lambda ended: ended.stored) == [(b.block_hash, b.group) for b in blocks]
            kv[3:5] = 0
            tier.load("r", blocks)
            assert wait_for(tier, lambda ended: ended.loaded) == ["r"]
            for block in blocks:
                for ref in caches.group_data_refs[block.group]:
                    span = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
                    assert torch.equal(kv[block.block_id, span], written[block.block_id - 3, span])
            assert len(tier.staging.free) == tier.staging.buffer.shape[0]
        finally:
            tier.shutdown()


def wait_for(tier, what, polls: int = 10_000):
    for _ in range(polls):
        if found := what(tier.poll()):
            return found
    raise AssertionError("the tier never reported it")


@contextlib.contextmanager
def read_only_mount(directory: Path, size: str = "4k") -> Iterator[Path]:
    """A read-only tmpfs of `size` at `directory` (root only: mount(8)), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only file system needs root (CI and sessions run as root)")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"ro,size={size}", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


@pytest.mark.parametrize("where", ["the mount", "a folder under it"])
def test_a_default_sized_tier_on_a_read_only_file_system_is_off_and_the_engine_serves(
        where, tiny_models, cold, tmp_path, caplog):
    """The probe's server stopped with "--kv-offload-disk-bytes 0 is less than one block":
    the default size (a tenth of the free space) is 0 there. The tier is off, saying where
    and why, and the engine serves."""
    with read_only_mount(tmp_path / "ro") as mount:
        directory = mount if where == "the mount" else mount / "tier"
        with tiered(tiny_models["qwen3"], "qwen3", directory, kv_offload_disk_bytes=None) as llm:
            tier = llm.engine.runner.connector.tiers["disk"]
            assert tier.off_reason is not None and str(directory) in tier.off_reason
            assert "read-only" in tier.off_reason or "Read-only" in tier.off_reason
            assert one_by_one(llm, prompts()) == cold["qwen3"]
        assert "KV disk tier turned off" in caplog.text


def test_a_default_size_under_one_block_turns_the_tier_off_saying_so(tiny_models, cold, monkeypatch, tmp_path):
    monkeypatch.setattr(disk, "default_disk_bytes", lambda directory: 100)
    with tiered(tiny_models["qwen3"], "qwen3", tmp_path, kv_offload_disk_bytes=None) as llm:
        reason = llm.engine.runner.connector.tiers["disk"].off_reason
        assert reason is not None and str(tmp_path) in reason and "less than one block" in reason
        assert one_by_one(llm, prompts()) == cold["qwen3"]


def test_an_explicit_size_under_one_block_is_refused_at_start(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="--kv-offload-disk-bytes 100 is less than one block"):
        tiered(tiny_models["qwen3"], "qwen3", tmp_path, kv_offload_disk_bytes=100)
