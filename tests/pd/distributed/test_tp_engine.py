"""An engine with `--tensor-parallel-size 2`: `pd.LLM` and `pd serve` give TP = 1's tokens;
a rank killed or hung stops the engine cleanly (in-flight requests answered, no process
left behind) or, with `--restart-engine`, a new engine with new ranks serves."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
import torch

from launch import http_client
from pd import LLM
from pd.config import EngineConfig
from pd.contracts.sampling_params import SamplingParams
from pd.worker.tp_ranks import rank_device
from tests.support.hf_reference import random_prompts
from tests.support.llm_runs import assert_logits_close
from tests.support.server_harness import running_server, wait_until
from tests.support.tp_processes import alive, rank_pids, stream_until_error

pytestmark = pytest.mark.slow

LOGIT_TOL = 2e-4


@pytest.mark.parametrize("arch", ["qwen3", "bamba"])
def test_llm_tp2_gives_tp1_logits_and_tokens(tiny_models, arch: str) -> None:
    prompts = random_prompts([29, 7, 40], seed=11)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results, hashes = {}, {}
    for tp in (1, 2):
        with LLM(str(tiny_models[arch]), dtype="float32", tensor_parallel_size=tp, num_threads=1,
                 keep_logits=True) as llm:
            outputs = llm.generate(prompts, params)
            results[tp] = ([o.token_ids for o in outputs], [o.logits for o in outputs])
            hashes[tp] = llm.engine.compat_hash()
            if tp == 2:
                engine_children = rank_pids(os.getpid())
                assert len(engine_children) == 1
        if tp == 2:
            assert not any(alive(p) for p in engine_children), "a rank outlived its engine"
    assert results[1][0] == results[2][0]
    assert_logits_close(results[1][1], results[2][1], LOGIT_TOL)
    assert hashes[1] == hashes[2], "blocks mean the same whatever the TP size: one compatibility hash"


def test_unseeded_sampling_keeps_every_rank_on_the_same_tokens(tiny_models) -> None:
    """Every rank samples from the same gathered logits with the same generator state:
    were rank 1 to draw other tokens, its inputs, and so the logits after the next
    all-reduce, would leave TP = 1's."""
    prompts = random_prompts([12, 20], seed=3)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        with LLM(str(tiny_models["qwen3"]), dtype="float32", tensor_parallel_size=tp, num_threads=1,
                 keep_logits=True) as llm:
            outputs = llm.generate(prompts, params)
            results[tp] = ([o.token_ids for o in outputs], [o.logits for o in outputs])
    assert results[1][0] == results[2][0]
    assert_logits_close(results[1][1], results[2][1], LOGIT_TOL)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_rank_stops_the_engine_and_answers_what_was_in_flight(tiny_models, tmp_path, fault: str) -> None:
    with running_server(tiny_models["qwen3"], tmp_path / "server.log", "--tensor-parallel-size", "2",
                        "--tp-timeout", "3") as server:
        engine_pid = server.health().json()["engine_pid"]
        (rank,) = rank_pids(engine_pid)
        family = [engine_pid, rank]
        start = time.monotonic()
        sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
        events = stream_until_error(server, engine_pid, lambda: os.kill(rank, sig))  # a process this test started
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_died"
        assert time.monotonic() - start < 30
        assert server.process.wait(30) == 1, server.log_tail()
        assert wait_until(lambda: not any(alive(p) for p in family), 10), "a rank or the engine was left behind"
        assert "tensor-parallel" in server.log_tail()


def test_with_restart_engine_a_new_engine_with_new_ranks_serves(tiny_models, tmp_path) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with running_server(tiny_models["qwen3"], tmp_path / "one.log") as single:
        expected = http_client().post(f"{single.url}/v1/completions", json=body, timeout=60).json()["choices"]
    with running_server(tiny_models["qwen3"], tmp_path / "server.log", "--tensor-parallel-size", "2",
                        "--restart-engine", "1") as server:
        assert http_client().post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"] == expected
        first = server.health().json()["engine_pid"]
        (rank,) = rank_pids(first)
        os.kill(rank, signal.SIGKILL)  # found by the idle engine's loop, no request needed
        assert wait_until(lambda: server.health().status_code == 200 and server.health().json()["engine_pid"] != first,
                          90), server.log_tail()
        assert not alive(first)
        assert len(rank_pids(server.health().json()["engine_pid"])) == 1
        assert http_client().post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"] == expected
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_tp_size_that_does_not_divide_the_heads_is_refused_at_start(tiny_models) -> None:
    with pytest.raises(Exception, match="does not divide"):
        LLM(str(tiny_models["qwen3"]), dtype="float32", tensor_parallel_size=3, num_threads=1)
    assert torch.distributed.is_initialized() is False


def test_rank_devices_count_from_the_engines_own() -> None:
    assert [rank_device("cuda:1", r) for r in range(3)] == ["cuda:1", "cuda:2", "cuda:3"]
    assert rank_device("cuda", 1) == "cuda:1"


def test_more_ranks_than_devices_is_refused_at_start(tiny_models) -> None:
    ranks = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(ValueError, match=f"{ranks} tensor-parallel ranks on cuda need CUDA devices 0..{ranks - 1}"):
        EngineConfig.from_flat(model=str(tiny_models["qwen3"]), device="cuda", tensor_parallel_size=ranks).resolve()


def test_a_start_that_fails_after_the_ranks_are_up_leaves_no_rank_behind(tiny_models) -> None:
    """Rank 0's side channel cannot bind (its port is taken) once the other ranks have
    built their models and connectors: the start fails with the reason, and rank 1 is
    stopped with it (the LLM's process lives on, so nothing else would end it)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(Exception, match="Address already in use"):
            LLM(str(tiny_models["qwen3"]), dtype="float32", tensor_parallel_size=2, num_threads=1,
                kv_connector="nixl", kv_side_channel_port=busy.getsockname()[1], kv_transfer_secret="x" * 32)
    assert wait_until(lambda: not rank_pids(os.getpid()), timeout=10), "a rank outlived the failed start"
    assert torch.distributed.is_initialized() is False
