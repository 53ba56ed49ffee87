"""EngineConfig: role defaults, refused combinations, resolution, and settings the engine applies."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from pd.config import EngineConfig, TransferSettings, add_engine_flags, config_from_args
from pd.config.engine import flat_default, flat_names
from pd.engine.core import EngineCore
from pd.kv_transfer.signing import DEFAULT_ALLOWED_PEERS
from pd.llm import LLM
from pd.models.make_model import make_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("role, connector", [("both", "null"), ("prefill", "nixl"), ("decode", "nixl")])
def test_the_role_picks_the_default_connector(role: str, connector: str) -> None:
    unsigned = {"allow_unsigned_kv_params": True}
    assert EngineConfig.from_flat(model="m", role=role, **unsigned).resolve().transfer.connector == connector
    assert EngineConfig.from_flat(model="m", role=role, kv_connector="nixl", **unsigned).resolve().transfer.connector \
        == "nixl"


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
        EngineConfig.from_flat(model="m", **kwargs)


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_a_nixl_server_needs_a_transfer_secret_unless_unsigned_parameters_are_allowed(role, monkeypatch) -> None:
    """Issue 31 row 6: secure by default. An empty secret means none, whatever the
    environment says."""
    monkeypatch.setenv("PD_KV_TRANSFER_SECRET", "from-the-environment")
    def secret(**kwargs) -> str | None:
        return EngineConfig.from_flat(model="m", kv_cache_memory=1 << 20, **kwargs).resolve().transfer.secret

    assert secret(role=role, kv_connector="nixl") == "from-the-environment"
    with pytest.raises(ValueError, match="needs a transfer secret"):
        secret(role=role, kv_connector="nixl", kv_transfer_secret="")
    monkeypatch.delenv("PD_KV_TRANSFER_SECRET")
    with pytest.raises(ValueError, match="--allow-unsigned-kv-params"):
        secret(role=role, kv_connector="nixl")
    assert secret(role=role, kv_connector="nixl", allow_unsigned_kv_params=True) is None
    assert secret(role="both") is None  # serving alone: nothing to sign


def test_num_threads_sets_the_engines_torch_threads(tmp_path) -> None:
    model = make_model("qwen3", tmp_path / "qwen3", seed=1)
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1  # not what it is already
    try:
        LLM(str(model), num_threads=wanted, max_model_len=256, kv_cache_memory=8 << 20)
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_repeated_allowed_peers_flags_add_and_none_means_loopback_without_a_secret(tiny_models) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    model = str(tiny_models["qwen3"])
    given = parser.parse_args(["--model", model, "--kv-allowed-peers", "10.0.0.0/8", "--kv-allowed-peers",
                               "192.168.1.2", "172.16.0.0/12"])
    assert config_from_args(given).transfer.allowed_peers == ("10.0.0.0/8", "192.168.1.2", "172.16.0.0/12")
    for secret in (None, "s"):  # given: with a secret or without one
        transfer = dataclasses.replace(config_from_args(given).transfer, secret=secret)
        assert transfer.peer_networks() == ("10.0.0.0/8", "192.168.1.2", "172.16.0.0/12")
    none_given = config_from_args(parser.parse_args(["--model", model])).transfer
    assert none_given.allowed_peers is None and none_given.peer_networks() == DEFAULT_ALLOWED_PEERS
    assert dataclasses.replace(none_given, secret="s").peer_networks() is None  # any peer that proves the secret


def test_resolve_decides_what_was_left_to_the_machine_and_changes_nothing_asked(tiny_models, monkeypatch) -> None:
    monkeypatch.setenv("PD_KV_CACHE_MEMORY", "12345678")
    asked = EngineConfig.from_flat(model=tiny_models["qwen3"], role="decode", allow_unsigned_kv_params=True)
    assert not asked.is_resolved and asked.model.dtype == "auto" and asked.cache.memory == "auto"
    resolved = asked.resolve()
    assert resolved.is_resolved and resolved is not asked
    assert (resolved.model.dtype, resolved.cache.memory, resolved.transfer.connector) == ("float32", 12345678, "nixl")
    assert "PD_KV_CACHE_MEMORY" in resolved.cache.memory_reason and resolved.model.dtype_reason != "as asked"
    assert asked.model.dtype == "auto"  # the config asked is left as it was
    with pytest.raises(ValueError, match="resolved config"):
        EngineCore(asked)


def test_every_flat_setting_is_one_field_of_one_group_with_its_flag() -> None:
    """Each setting is declared once: its flat name (a flag's dest, pd.LLM's keyword) maps
    to one field, and the flag's default is that field's default."""
    names = flat_names()
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    dests = {action.dest: action.default for action in parser._actions if action.dest != "help"}
    assert set(names) - {"role", "kv_cache_max_tokens"} == set(dests)  # role is pd serve's flag; max tokens: auto's
    for name, default in dests.items():
        if name not in ("model", "kv_allowed_peers"):  # required; repeatable (None: the field's default)
            assert default == flat_default(name), name
    assert len({target for target in names.values()}) == len(names)


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(TypeError, match="'kv_leese_seconds' is not an engine setting"):
        EngineConfig.from_flat(model="m", kv_leese_seconds=5)


PD_SETTINGS = {"lease_seconds", "read_timeout_s", "ucx_transports", "side_channel_port", "kv_load_failure_policy",
               "kv_max_held_fraction", "skip_partial_groups_on_remote_prefill", "allowed_peers", "allow_unsigned"}
DECLARED_IN = {"pd/kv_transfer/connector_config.py", "pd/config/settings.py"}


def _absent(default: ast.expr | None) -> bool:
    """No default, or None (the setting absent): not a second declaration of its value."""
    return default is None or (isinstance(default, ast.Constant) and default.value is None)


def defaults_given(path: Path) -> list[str]:
    """`name: type = default` fields and `name=default` parameters of a PD setting's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not _absent(node.value):
            found += [node.target.id] if node.target.id in PD_SETTINGS else []
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += list(zip(node.args.kwonlyargs, node.args.kw_defaults))
            found += [a.arg for a, default in pairs if a.arg in PD_SETTINGS and not _absent(default)]
    return [f"{path.relative_to(ROOT)}: {name}" for name in found]


def test_each_pd_setting_has_its_default_in_one_place() -> None:
    """The PD settings were once declared in three classes with their defaults; the
    connector's, the NIXL worker's and the scheduler's configs are now projections."""
    from connectors.nixl.worker import NixlWorkerConfig
    from pd.kv_transfer.connector_config import ConnectorConfig

    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(ConnectorConfig))
    assert {f.name for f in dataclasses.fields(TransferSettings)}.isdisjoint(
        f.name for f in dataclasses.fields(NixlWorkerConfig))
    paths = [p for package in ("pd", "connectors", "proxy") for p in sorted((ROOT / package).rglob("*.py"))]
    elsewhere = [hit for p in paths if str(p.relative_to(ROOT)) not in DECLARED_IN for hit in defaults_given(p)]
    assert elsewhere == []
    assert len([hit for p in paths if str(p.relative_to(ROOT)) in DECLARED_IN for hit in defaults_given(p)]) \
        == len(PD_SETTINGS)  # each declared once where it belongs, so the walk sees defaults
