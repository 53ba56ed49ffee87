"""A steady decode through the engine takes no page faults: the decode workspace and the
engine's malloc settings (`pd.worker.memory`) keep every step's memory mapped. Before
them, this shape (tiny Qwen 3, 8 requests at context 1,500) took ~14,000 faults a step."""

from __future__ import annotations

import resource

import pytest
import torch

from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.models.make_model import make_model


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.slow
def test_steady_decode_steps_take_no_page_faults(tmp_path) -> None:
    llm = LLM(str(make_model("qwen3", tmp_path / "qwen3", seed=1)), dtype="bfloat16", max_num_seqs=8,
              max_model_len=2048, kv_cache_memory=256 << 20)
    engine, gen = llm.engine, torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(Request(f"r{i}", torch.randint(10, 4000, (1500,), generator=gen).tolist(), params))
    while engine.scheduler.num_waiting or any(len(r.output_token_ids) < 4 for r in engine.scheduler.running):
        engine.step()
    faults = []
    for _ in range(10):
        before = minor_faults()
        engine.step()
        faults.append(minor_faults() - before)
    assert len(engine.scheduler.running) == 8  # all decoding: the steps measured are steady ones
    assert sorted(faults)[5] <= 64, faults  # the median step
