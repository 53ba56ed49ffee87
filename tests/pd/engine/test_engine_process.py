"""EngineClient + run_engine_core: the engine core in its own process behind ZMQ.

One engine serves the request tests (greedy tokens equal in-process `pd.LLM`, concurrency,
aborts, refusals); the lifecycle tests (startup failure, SIGKILL, SIGTERM, shutdown)
each start their own, and every process started is stopped in a `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from pd.config import EngineConfig
from pd.contracts.sampling_params import SamplingParams
from pd.engine.client import EngineClient, EngineDeadError, EngineStartupError
from pd.engine.ipc_messages import EngineRequest, RequestOutput
from pd.llm import LLM
from pd.models.make_model import make_model

ENGINE_ARGS = {"kv_cache_memory": 32 << 20, "max_model_len": 512}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)  # seconds of decoding
PROMPT_LENGTHS = [5, 17, 33, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model("qwen3", tmp_path_factory.mktemp("engine_process") / "qwen3")


@pytest.fixture(scope="module")
def config(model_dir) -> EngineConfig:
    return EngineConfig.from_flat(model=model_dir, **ENGINE_ARGS).resolve()


@contextlib.contextmanager
def started(config: EngineConfig) -> Iterator[EngineClient]:
    client = EngineClient.start(config)
    try:
        yield client
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def engine(config) -> Iterator[EngineClient]:
    with started(config) as client:
        yield client


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, 4000, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> list[list[int]]:
    outputs = LLM(str(model_dir), **ENGINE_ARGS).generate(prompts, GREEDY)
    return [out.token_ids for out in outputs]


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest.create(request_id, prompt, params)


async def collect(outputs: AsyncIterator[RequestOutput]) -> tuple[list[int], RequestOutput]:
    tokens: list[int] = []
    async for output in outputs:
        tokens += output.new_token_ids
    return tokens, output


def child_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def assert_no_process(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---- requests against one shared engine -------------------------------------------


def test_engine_info(engine, config):
    info = engine.info
    assert info.max_model_len == 512
    assert info.vocab_size == 4096
    assert info.architectures == ["Qwen3ForCausalLM"]
    assert info.group_names == ["0:full_attention"]
    assert info.block_sizes == [config.cache.block_size]
    assert info.num_blocks > 1 and info.eos_token_ids


def test_greedy_matches_in_process_llm(engine, prompts, reference):
    async def main():
        return [await collect(engine.generate(request(f"seq-{i}", p))) for i, p in enumerate(prompts)]

    for (tokens, last), expected in zip(run(main()), reference):
        assert tokens == expected
        assert last.finish_reason == "length" and last.finished


def test_concurrent_generates(engine, prompts, reference):
    async def main():
        return await asyncio.gather(*(collect(engine.generate(request(f"conc-{i}", p)))
                                      for i, p in enumerate(prompts)))

    results = run(main())
    assert [tokens for tokens, _ in results] == reference
    assert engine.stats.num_running == 0 and engine.stats.kv_usage == 0.0


def test_abort_mid_generation_frees_blocks(engine, prompts, reference):
    async def main():
        outputs = []
        async for output in engine.generate(request("to-abort", prompts[0], LONG)):
            outputs.append(output)
            if len(outputs) == 3:
                assert engine.stats.kv_usage > 0
                await engine.abort(["to-abort"])
        assert outputs[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in outputs) < LONG.max_tokens
        assert engine.stats.kv_usage == 0.0 and engine.stats.num_running == 0
        tokens, _ = await collect(engine.generate(request("after-abort", prompts[1])))
        assert tokens == reference[1]
        assert engine.stats.kv_usage == 0.0

    run(main())


async def assert_nothing_left_running(engine: EngineClient, prompt: list[int]) -> None:
    """A one-token probe goes through the core's input after any abort sent before it;
    a request that was not aborted would still be running when the probe finishes."""
    await collect(engine.generate(request(f"probe-{time.monotonic_ns()}", prompt,
                                          SamplingParams(max_tokens=1, temperature=0))))
    assert engine.stats.num_running == 0 and engine.stats.kv_usage == 0.0


def test_aclose_aborts(engine, prompts):
    async def main():
        outputs = engine.generate(request("closed-early", prompts[2], LONG))
        first = await outputs.__anext__()
        assert first.request_id == "closed-early" and not first.finished
        await outputs.aclose()
        await assert_nothing_left_running(engine, prompts[3])

    run(main())


def test_cancelled_consumer_aborts(engine, prompts):
    async def main():
        started_decoding = asyncio.Event()

        async def consume():
            async for _ in engine.generate(request("cancelled", prompts[2], LONG)):
                started_decoding.set()

        task = asyncio.create_task(consume())
        await started_decoding.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_nothing_left_running(engine, prompts[3])

    run(main())


def test_refused_requests_raise_and_leave_the_engine_serving(engine, prompts, reference):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine.generate(request("too-long", list(range(10, 522)))))
        bad_params = SamplingParams()
        bad_params.top_p = 0.0  # unchecked, as a client that skips the check would send it
        bad = EngineRequest(request_id="bad-top-p", prompt_token_ids=prompts[0], sampling_params=bad_params)
        with pytest.raises(ValueError, match="top_p"):
            await collect(engine.generate(bad))
        outputs = engine.generate(request("in-flight", prompts[0], LONG))
        await outputs.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await collect(engine.generate(request("in-flight", prompts[1])))
        await outputs.aclose()
        tokens, _ = await collect(engine.generate(request("too-long", prompts[1])))  # id reusable
        assert tokens == reference[1]

    run(main())
    assert engine.is_alive and engine.dead_error is None


# ---- lifecycle: each test its own engine --------------------------------------------


def test_bad_model_dir_raises_startup_error(tmp_path):
    before = child_pids()
    with pytest.raises(EngineStartupError, match="no config.json"):
        EngineClient.start(EngineConfig.from_flat(model=tmp_path, **ENGINE_ARGS).resolve())
    assert child_pids() <= before


def test_killed_core_fails_pending_generate(config, prompts):
    with started(config) as engine:
        async def main():
            outputs = engine.generate(request("doomed", prompts[0], LONG))
            await outputs.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="-9"):
                await asyncio.wait_for(collect(outputs), 30)  # a hang fails the test (TimeoutError)
            assert not engine.is_alive
            with pytest.raises(EngineDeadError):
                await collect(engine.generate(request("after-death", prompts[0])))

        run(main())
        assert engine.exitcode == -signal.SIGKILL


def test_sigterm_exits_cleanly(config, prompts):
    with started(config) as engine:
        async def main():
            outputs = engine.generate(request("terminated", prompts[0], LONG))
            await outputs.__anext__()
            os.kill(engine.pid, signal.SIGTERM)
            with pytest.raises(EngineDeadError, match="exited with code 0"):
                await collect(outputs)

        run(main())
        assert engine.exitcode == 0 and not engine.is_alive


def test_shutdown_stops_the_process(config, prompts):
    with started(config) as engine:
        pid = engine.pid

        async def main():
            outputs = engine.generate(request("pending", prompts[0], LONG))
            await outputs.__anext__()
            engine.shutdown()
            with pytest.raises(EngineDeadError, match="shut down"):
                await collect(outputs)

        run(main())
        assert engine.exitcode == 0  # it stopped on the Shutdown message, not a signal
        assert_no_process(pid)
        engine.shutdown()  # idempotent
        with pytest.raises(EngineDeadError):
            run(collect(engine.generate(request("after-shutdown", prompts[0]))))


def test_token_ids_outside_the_vocabulary_are_refused_not_computed(engine, prompts, reference):
    """Before they were checked here, such a request reached the model and killed the core."""
    from pd.engine.client import RequestRefusedError
    from pd.kv_transfer.params import RemotePrefillParams

    vocab = engine.info.vocab_size
    first_out_of_vocab = RemotePrefillParams(True, "p", "127.0.0.1", 1, "p1", [[1]], len(prompts[0]), [vocab], 16)
    bad = {"prompt": EngineRequest.create("a", prompts[0] + [vocab + 5], SamplingParams()),
           "stop_token_ids": EngineRequest.create("b", prompts[0], SamplingParams(stop_token_ids=(vocab,))),
           "first_token_ids": EngineRequest.create("c", prompts[0], SamplingParams(), first_out_of_vocab)}
    pid = engine.pid

    async def main():
        for what, req in bad.items():
            with pytest.raises(RequestRefusedError, match=what) as info:
                await collect(engine.generate(req))
            assert info.value.code == "invalid_request"
        tokens, _ = await collect(engine.generate(request("after", prompts[1])))
        assert tokens == reference[1]

    run(main())
    assert engine.is_alive and engine.pid == pid and engine.stats.kv_usage == 0.0
