"""KV offload tiers on a GPU engine: the host tier (pinned memory, a copy stream of its own)
and the disk tier (blocks through pinned host rows, NIXL's POSIX backend) give back what
the device cache lost, and the tokens equal a cold computation on the same device.

Skipped where torch sees no CUDA device (CI); run on a GPU machine when one is lent
(.ci/gpu/checks.sh runs tests/pd/cuda)."""

from __future__ import annotations

import random

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_a_gpu_engine_loads_its_prompts_back_from_host_memory_and_disk(arch, tiny_models, tmp_path):
    rng = random.Random(arch)
    prompts = [[rng.randrange(5, 200) for _ in range(200)] for _ in range(8)]
    common = dict(device="cuda", dtype="float32", max_model_len=512, num_threads=1)
    with LLM(str(tiny_models[arch]), **common) as llm:
        cold = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    with LLM(str(tiny_models[arch]), **common, kv_cache_memory=4_000_000, kv_offload_host_bytes=1_000_000,
             kv_offload_disk_path=tmp_path) as llm:
        tiers = llm.engine.runner.connector.tiers
        assert tiers["disk"].off_reason is None and tiers["disk"].staging is not None
        for _ in range(2):
            assert [llm.generate([p], PARAMS)[0].token_ids for p in prompts] == cold
        assert llm.engine.kv_cache_manager.reset_prefix_cache()  # what is left on the device goes too
        # Newest first: the host tier (1 MB, LRU) holds the last prompts stored; in the stored
        # order, each read would find them already pushed out by the ones before.
        assert [llm.generate([p], PARAMS)[0].token_ids for p in prompts[::-1]] == cold[::-1]
        assert tiers["host"].counters["loaded_blocks"] > 0 and tiers["disk"].counters["loaded_blocks"] > 0
        assert tiers["disk"].counters["corrupt_blocks"] == 0
        assert llm.engine.kv_cache_manager.usage == 0.0
