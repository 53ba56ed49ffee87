"""Sharded models: TP = 2 (two processes, gloo) gives the logits of TP = 1, prefill and
decode, for every family; each rank holds about half the weights."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch import free_port
from pd.config import EngineConfig
from pd.distributed.shard import TPShard
from pd.kv_cache.layout import KVCacheLayoutError
from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig
from pd.worker import rank_setup
from pd.worker.rank_setup import kv_cache_config, whole_kv_cache_config
from tests.support.gguf_files import write_qwen3_gguf
from tests.support.hf_reference import random_prompts
from tests.support.tp_forward import rank_logits

ARCHS = ["qwen3", "gemma3", "bamba", "granitehybrid"]
TOL = 2e-4


def _rank(queue, model, rank, size, prompt, decode, port, quantization):
    try:
        logits, weight_bytes = rank_logits(model, TPShard(rank, size), prompt, decode, port, quantization)
        queue.put((rank, ([t.numpy() for t in logits], weight_bytes)))
    except BaseException as exc:  # the parent reports it
        queue.put((rank, repr(exc)))
        raise


def run_tp(model: Path, size: int, prompt: list[int], decode: list[int], quantization: str | None = None
           ) -> list[tuple[list[torch.Tensor], int]]:
    """Every rank's (logits per step, parameter bytes), the ranks run as `size` spawned
    processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(queue, model, r, size, prompt, decode, port, quantization))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not errors, errors
    return [([torch.from_numpy(a) for a in results[r][0]], results[r][1]) for r in range(size)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {arch: make_model(arch, root / arch, seed=3) for arch in ARCHS}


def assert_same_logits(model: Path, size: int = 2, quantization: str | None = None, tol: float = TOL,
                       weight_slack: float = 1.05) -> None:
    """TP = `size` gives TP = 1's logits at every step, on every rank; each rank holds
    at most 1/size of the weights and a little more (norms, the padded vocabulary)."""
    prompt, decode = random_prompts([37], seed=5)[0], random_prompts([4], seed=6)[0]
    ((single, whole),) = run_tp(model, 1, prompt, decode, quantization)
    ranks = run_tp(model, size, prompt, decode, quantization)
    for step, want in enumerate(single):
        for logits, _ in ranks:  # every rank sees the gathered logits
            diff = (logits[step] - want).abs().max().item()
            assert diff <= tol, f"{model.name} step {step}: max abs logit diff {diff:.3g}"
        assert all(torch.equal(ranks[0][0][step], logits[step]) for logits, _ in ranks)
    assert [int(s.argmax()) for s in single] == [int(s.argmax()) for s in ranks[0][0]]
    assert all(weight_bytes <= whole / size * weight_slack for _, weight_bytes in ranks), (whole, [b for _, b in ranks])


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_equal_tp1(checkpoints, arch: str) -> None:
    assert_same_logits(checkpoints[arch])


def test_tp2_from_a_quantized_gguf_equals_tp1(checkpoints, tmp_path) -> None:
    """Each rank reads and dequantizes its rows or columns of the Q8_0 weights only."""
    path = tmp_path / "qwen3.gguf"
    write_qwen3_gguf(checkpoints["qwen3"], path, quantize_matrices=True)
    assert_same_logits(path)


def test_tp2_int8_quantizes_each_shard(checkpoints) -> None:
    """int8 per output channel: a shard's channels are quantized as they are unsharded,
    save row-parallel layers, whose input columns are cut (a small difference)."""
    assert_same_logits(checkpoints["qwen3"], quantization="int8", tol=0.05)


def test_tp4_replicates_the_kv_heads(checkpoints) -> None:
    """Two KV heads over four ranks: each rank holds one, replicated (its k and v
    projections too: 8 % more than a quarter of the weights on this model)."""
    assert_same_logits(checkpoints["qwen3"], size=4, weight_slack=1.1)


@pytest.mark.parametrize("arch", ["bamba", "granitehybrid"])
def test_every_tp_size_keeps_the_whole_models_block_size(checkpoints, arch: str) -> None:
    """A hybrid's block size is raised until an attention page holds a Mamba state; at
    TP = 4 the tiny hybrids' KV heads are replicated and their Mamba heads split, so a
    rank alone would pick 80 tokens where TP = 1 picks 144, and servers of the two sizes
    could not exchange blocks."""
    config = EngineConfig.from_flat(model=str(checkpoints[arch]), dtype="float32", kv_cache_memory=1 << 26).resolve()
    sizes = {}
    for tp in (1, 2, 4):
        model_config = ModelConfig.from_dir(config.model.path, "float32", tp=TPShard(0, tp))
        sizes[tp] = kv_cache_config(config, model_config, load_model(model_config)).block_sizes
    assert sizes[1] == sizes[2] == sizes[4] == whole_kv_cache_config(config).block_sizes


def test_a_rank_that_cannot_hold_the_whole_models_block_size_is_refused(checkpoints, monkeypatch) -> None:
    config = EngineConfig.from_flat(model=str(checkpoints["bamba"]), dtype="float32", kv_cache_memory=1 << 26).resolve()
    model_config = ModelConfig.from_dir(config.model.path, "float32", tp=TPShard(0, 2))
    model = load_model(model_config)
    monkeypatch.setattr(rank_setup, "whole_kv_cache_config", lambda _: SimpleNamespace(block_sizes=[16, 16, 16]))
    with pytest.raises(KVCacheLayoutError, match=r"raise --block-size to 144 on every server"):
        kv_cache_config(config, model_config, model)
