"""Checkpoint loading: single file or sharded index, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig
from pd.models.registry import model_class


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_model("qwen3", tmp_path_factory.mktemp("m") / "qwen3", seed=3)


def copy_checkpoint(src: Path, dst: Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(src, dst)
    if weights is not None:
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_sharded_checkpoint_loads_the_same_weights(qwen3: Path, tmp_path: Path) -> None:
    weights = load_file(str(qwen3 / "model.safetensors"))
    sharded = copy_checkpoint(qwen3, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    one = load_model(ModelConfig.from_dir(qwen3)).state_dict()
    two = load_model(ModelConfig.from_dir(sharded)).state_dict()
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)
    fused = one["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(fused[:256], weights["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(fused[256 + 128 :], weights["model.layers.0.self_attn.v_proj.weight"])


def test_tied_embeddings_share_the_embedding(qwen3: Path) -> None:
    model = load_model(ModelConfig.from_dir(qwen3))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_loading_draws_no_random_numbers_and_every_parameter_is_the_checkpoints(arch: str, tmp_path: Path) -> None:
    """Layers are built without random fills (every parameter is loaded or the load
    fails): torch's random state is untouched, and torch.nn.init works afterwards."""
    model_dir = make_model(arch, tmp_path / arch, seed=3)
    weights = load_file(str(model_dir / "model.safetensors"))
    state = torch.random.get_rng_state()
    model = load_model(ModelConfig.from_dir(model_dir))
    assert torch.equal(torch.random.get_rng_state(), state)
    loaded = {name: p for name, p in model.named_parameters()}
    assert all(torch.equal(loaded[name], tensor.to(loaded[name].dtype)) for name, tensor in weights.items()
               if name in loaded)
    assert torch.nn.init.normal_(torch.zeros(64)).abs().sum() > 0


def test_a_missing_weight_is_named(qwen3: Path, tmp_path: Path) -> None:
    weights = load_file(str(qwen3 / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    broken = copy_checkpoint(qwen3, tmp_path / "missing", weights)
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(ModelConfig.from_dir(broken))


def test_an_unknown_or_misshapen_weight_is_refused(qwen3: Path, tmp_path: Path) -> None:
    weights = load_file(str(qwen3 / "model.safetensors"))
    extra = copy_checkpoint(qwen3, tmp_path / "extra", {**weights, "model.bogus.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="model.bogus.weight"):
        load_model(ModelConfig.from_dir(extra))
    weights["model.norm.weight"] = torch.ones(7)
    bad = copy_checkpoint(qwen3, tmp_path / "shape", weights)
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(7,\)"):
        load_model(ModelConfig.from_dir(bad))


def test_unsupported_architectures_and_missing_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="supported: .*Qwen3ForCausalLM"):
        model_class(["MixtralForCausalLM"])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(ModelConfig.from_dir(tmp_path))


def test_config_reads_published_forms(tmp_path: Path) -> None:
    config = {"architectures": ["BambaForCausalLM"], "vocab_size": 10, "eos_token_id": 3,
              "time_step_limit": [0.0, {"__float__": "Infinity"}], "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    loaded = ModelConfig.from_dir(tmp_path, max_model_len=32)
    assert loaded.get("time_step_limit") == [0.0, math.inf]
    assert loaded.eos_token_ids == {3, 5}
    assert loaded.context_len == 32
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_dir(tmp_path, dtype="int4")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_a_skeleton_for_the_kv_layout_costs_no_torch_dynamo_import(arch: str, tmp_path: Path) -> None:
    """Every engine and rank builds the model on `meta` to size its KV cache: RoPE's
    tables and Mamba's A_log computed there ran Python decompositions whose first use
    imports torch._dynamo (~1 s of CPU per process start). In a fresh process, since this
    one may hold it."""
    import subprocess
    import sys

    model = make_model(arch, tmp_path / arch, seed=1)
    script = ("import sys; from pd.models.loader import model_skeleton; from pd.models.model_config import ModelConfig;"
              f"skeleton = model_skeleton(ModelConfig.from_dir({str(model)!r}));"
              "assert skeleton.kv_cache_specs(16, hybrid=True);"
              "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_loading_shows_plain_progress_lines_per_tensor_on_stderr_off_a_terminal(qwen3: Path, capsys) -> None:
    total = len(load_file(str(qwen3 / "model.safetensors")))
    load_model(ModelConfig.from_dir(qwen3))
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and "\r" not in err
    assert lines[0].startswith("loading weights: ") and f"/{total} tensors (" in lines[0]
    assert lines[-1].startswith(f"loading weights: {total}/{total} tensors (100%) in ")
    assert len(lines) <= 10


def test_only_rank_0_shows_the_loading_progress(qwen3: Path, capsys) -> None:
    from pd.distributed.shard import TPShard

    load_model(ModelConfig.from_dir(qwen3, tp=TPShard(rank=1, size=2)))
    assert capsys.readouterr().err == ""
