"""EngineConfig: role defaults, refused combinations, and settings the engine applies."""

from __future__ import annotations

import argparse

import pytest
import torch

from pd.config import EngineConfig, add_engine_flags
from pd.kv_transfer.signing import DEFAULT_ALLOWED_PEERS
from pd.llm import LLM
from pd.models.make_model import make_model


@pytest.mark.parametrize("role, connector", [("both", "null"), ("prefill", "nixl"), ("decode", "nixl")])
def test_the_role_picks_the_default_connector(role: str, connector: str) -> None:
    assert EngineConfig(model="m", role=role).kv_connector == connector
    assert EngineConfig(model="m", role=role, kv_connector="nixl").kv_connector == "nixl"


@pytest.mark.parametrize("kwargs, message", [
    ({"role": "prefill", "kv_connector": "null"}, "--kv-connector nixl"),
    ({"role": "router"}, "role must be one of"),
    ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be one of recompute, fail"),
    ({"num_threads": 0}, "num_threads must be positive"),
    ({"kv_lease_seconds": 0}, "kv_lease_seconds must be positive"),
    ({"kv_read_timeout": 0}, "kv_read_timeout must be positive"),
    ({"kv_ucx_transports": "sm, tcp"}, "kv_ucx_transports must be auto or a UCX_TLS list"),
    ({"kv_ucx_transports": ""}, "kv_ucx_transports must be auto or a UCX_TLS list"),
    ({"logprobs_mode": "processed_logits"}, "logprobs_mode must be one of processed, raw"),
    ({"kv_offload_disk_bytes": 1 << 30}, "give kv_offload_disk_path too"),
    ({"kv_offload_host_bytes": 0}, "kv_offload_host_bytes must be positive"),
    ({"kv_offload_disk_path": "/tmp/t", "kv_offload_disk_bytes": -1}, "kv_offload_disk_bytes must be positive"),
    ({"kv_offload_host_bytes": 1 << 20, "enable_prefix_caching": False}, "need prefix caching on"),
    ({"kv_offload_disk_path": "/tmp/t", "tensor_parallel_size": 2}, "tensor-parallel size 1 for now"),
])
def test_bad_settings_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **kwargs)


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_a_nixl_server_needs_a_transfer_secret_unless_unsigned_parameters_are_allowed(role, monkeypatch) -> None:
    """Issue 31 row 6: secure by default. An empty secret means none, whatever the
    environment says."""
    monkeypatch.setenv("PD_KV_TRANSFER_SECRET", "from-the-environment")
    assert EngineConfig(model="m", role=role, kv_connector="nixl").kv_transfer_secret == "from-the-environment"
    with pytest.raises(ValueError, match="needs a transfer secret"):
        EngineConfig(model="m", role=role, kv_connector="nixl", kv_transfer_secret="")
    monkeypatch.delenv("PD_KV_TRANSFER_SECRET")
    with pytest.raises(ValueError, match="--allow-unsigned-kv-params"):
        EngineConfig(model="m", role=role, kv_connector="nixl")
    assert EngineConfig(model="m", role=role, kv_connector="nixl", allow_unsigned_kv_params=True).kv_transfer_secret \
        is None
    assert EngineConfig(model="m", role="both").kv_transfer_secret is None  # serving alone: nothing to sign


def test_num_threads_sets_the_engines_torch_threads(tmp_path) -> None:
    model = make_model("qwen3", tmp_path / "qwen3", seed=1)
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1  # not what it is already
    try:
        LLM(str(model), num_threads=wanted, max_model_len=256, kv_cache_memory=8 << 20)
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_repeated_allowed_peers_flags_add_and_none_keeps_loopback(tiny_models) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    model = str(tiny_models["qwen3"])
    given = parser.parse_args(["--model", model, "--kv-allowed-peers", "10.0.0.0/8", "--kv-allowed-peers",
                               "192.168.1.2", "172.16.0.0/12"])
    assert EngineConfig.from_args(given).kv_allowed_peers == ("10.0.0.0/8", "192.168.1.2", "172.16.0.0/12")
    assert EngineConfig.from_args(parser.parse_args(["--model", model])).kv_allowed_peers == DEFAULT_ALLOWED_PEERS
