"""A fault while computing a batch fails the requests of that batch and nothing else:
the core keeps stepping, frees their blocks, and serves the next requests."""

from __future__ import annotations

import pytest
import torch

from pd.config import EngineConfig
from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.engine.core import EngineCore
from pd.models.make_model import make_model

POISON = 4000  # a token id the patched model refuses
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> EngineCore:
    model = make_model("qwen3", tmp_path_factory.mktemp("core_faults") / "qwen3")
    core = EngineCore(EngineConfig.from_flat(model=model, max_model_len=256, kv_cache_memory=8 << 20,
                                             num_threads=1).resolve())
    yield core
    core.shutdown()


def run_to_end(core: EngineCore) -> list:
    outputs = []
    for _ in range(1000):
        if not core.has_work():
            return outputs
        outputs += core.step()
    pytest.fail("the core never finished its requests")


def test_a_batch_that_raises_fails_its_requests_and_the_core_goes_on(core, monkeypatch) -> None:
    reference = run_to_end_with(core, Request("ref", list(range(10, 30)), GREEDY))
    forward = core.model.forward

    def poisoned(input_ids: torch.Tensor, positions: torch.Tensor):
        if bool((input_ids == POISON).any()):
            raise IndexError("poisoned batch")
        return forward(input_ids, positions)

    monkeypatch.setattr(core.model, "forward", poisoned)
    outputs = run_to_end_with(core, Request("bad", [POISON] + list(range(10, 30)), GREEDY), raw=True)
    (failed,) = [o for o in outputs if o.finished]
    assert (failed.finish_reason, failed.error_code) == ("error", "internal_error")
    assert "IndexError: poisoned batch" in failed.error
    assert core.kv_cache_manager.usage == 0.0
    assert run_to_end_with(core, Request("again", list(range(10, 30)), GREEDY)) == reference
    assert "bad" not in core.runner.requests  # forgotten with the next step
    core.kv_cache_manager.check_integrity()


def run_to_end_with(core: EngineCore, request: Request, raw: bool = False):
    core.add_request(request)
    outputs = run_to_end(core)
    return outputs if raw else [t for o in outputs for t in o.new_token_ids]
