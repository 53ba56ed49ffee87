"""EngineConfig: everything one engine is started with, as frozen groups (settings.py),
checked across groups once; `resolve()` reads what the settings leave to the machine
(files, devices, the environment) and returns a new config with every `auto` decided."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pd.config.settings import (
    CacheSettings,
    ModelSettings,
    OffloadSettings,
    ParallelSettings,
    SchedulerSettings,
    TelemetrySettings,
)
from pd.kv_transfer.connector_config import TransferSettings
from pd.kv_transfer.connectors import AUTO_CONNECTOR, NULL_CONNECTOR
from pd.kv_transfer.signing import SECRET_ENV, secret_from_env
from pd.models.model_config import AUTO_DTYPE, resolve_dtype, resolve_quantization

ROLES = ("both", "prefill", "decode")
GROUPS = {"model": ModelSettings, "cache": CacheSettings, "scheduler": SchedulerSettings,
          "parallel": ParallelSettings, "transfer": TransferSettings, "offload": OffloadSettings,
          "telemetry": TelemetrySettings}


def flat_names() -> dict[str, tuple[str, str]]:
    """Each setting's flat name (its `pd serve` flag's dest, `pd.LLM`'s keyword) -> (group,
    field); `role` is the config's own."""
    names = {"role": ("", "role")}
    for group, kind in GROUPS.items():
        for f in fields(kind):
            if not f.metadata.get("resolved"):
                names[f.metadata.get("flat", f.name)] = (group, f.name)
    return names


def flat_default(name: str) -> Any:
    """The default of the setting whose flat name is `name` (a flag's default is its field's)."""
    group, attribute = flat_names()[name]
    kind = EngineConfig if not group else GROUPS[group]
    return next(f.default for f in fields(kind) if f.name == attribute)


@dataclass(frozen=True)
class EngineConfig:
    """One engine's settings. The role sets defaults only: what a server does with a
    request is decided per request, by its `kv_transfer_params` (DESIGN.md, "PD
    protocol"). An engine is started with a resolved config (`resolve()`)."""

    model: ModelSettings
    cache: CacheSettings = field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    role: str = "both"

    def __post_init__(self) -> None:
        """What the groups' settings must agree on."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role != "both" and self.transfer.connector == NULL_CONNECTOR:
            raise ValueError(f"a {self.role} server moves KV to or from its peer: use --kv-connector nixl "
                             "(or --role both to serve alone)")
        if self.model.quantization == "gguf" and self.parallel.size != 1:
            raise ValueError("quantization gguf serves one rank: use --tensor-parallel-size 1, or --quantization "
                             "none or int8 with tensor parallelism")
        if self.offload.any and not self.cache.enable_prefix_caching:
            raise ValueError("the KV offload tiers keep prefix-cache blocks: they need prefix caching on")
        if self.offload.any and self.parallel.size > 1:
            raise ValueError("the KV offload tiers serve tensor-parallel size 1 for now (each rank would need its "
                             "own tiers and the loads joined across ranks)")

    @classmethod
    def from_flat(cls, **settings: Any) -> EngineConfig:
        """The config from flat names (`model="path", kv_cache_memory=..., ...`: the flags'
        dests, `pd.LLM`'s keywords); TypeError naming one that is no setting."""
        names = flat_names()
        grouped: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        top: dict[str, Any] = {}
        for name, value in settings.items():
            if name not in names:
                raise TypeError(f"{name!r} is not an engine setting")
            group, attribute = names[name]
            (grouped[group] if group else top)[attribute] = _typed(name, value)
        return cls(**{group: GROUPS[group](**values) for group, values in grouped.items()}, **top)

    def resolve(self) -> EngineConfig:
        """A new config with what was left to the machine decided: the dtype, quantization
        and KV cache size (the model's files, the device, $PD_KV_CACHE_MEMORY), the
        connector by role, the transfer secret ($PD_KV_TRANSFER_SECRET); and the checks
        that need them. Called once, where an engine's config is made."""
        model = self._resolved_model()
        resolved = replace(self, model=model, cache=self._resolved_cache(model), transfer=self._resolved_transfer())
        resolved._check_resolved()
        return resolved

    def _resolved_model(self) -> ModelSettings:
        model = self.model
        if model.dtype == AUTO_DTYPE:
            # the device (a torch import) is looked up only for a GGUF
            dtype, why = resolve_dtype(model.path, AUTO_DTYPE, lambda: model.torch_device)
            model = replace(model, dtype=dtype, dtype_reason=why)
        if model.quantization == "auto":
            quantization, why = resolve_quantization(model.path, model.dtype, lambda: model.torch_device,
                                                     self.parallel.size)
            model = replace(model, quantization=quantization, quantization_reason=why)
        return model

    def _resolved_cache(self, model: ModelSettings) -> CacheSettings:
        if self.cache.memory != "auto":
            return self.cache
        from pd.kv_cache.sizing import MAX_TOKENS, auto_kv_cache_memory

        size, why = auto_kv_cache_memory(model.path, lambda: model.torch_device, self.parallel.size)
        return replace(self.cache, memory=size, memory_reason=why,
                       max_tokens=MAX_TOKENS if self.cache.max_tokens is None else self.cache.max_tokens)

    def _resolved_transfer(self) -> TransferSettings:
        transfer = self.transfer
        if transfer.connector == AUTO_CONNECTOR:
            transfer = replace(transfer, connector=NULL_CONNECTOR if self.role == "both" else "nixl")
        secret = secret_from_env() if transfer.secret is None else transfer.secret or None  # "": none
        return replace(transfer, secret=secret)

    def _check_resolved(self) -> None:
        if self.model.quantization == "gguf":
            from pd.models.gguf import is_gguf

            if not is_gguf(self.model.path):
                raise ValueError(f"quantization gguf computes from a .gguf file's blocks; {self.model.path} is not one")
        transfer = self.transfer
        if transfer.connector != NULL_CONNECTOR and transfer.secret is None and not transfer.allow_unsigned:
            raise ValueError(f"a server with the {transfer.connector} connector needs a transfer secret shared by "
                             f"the deployment ({SECRET_ENV}, or --kv-transfer-secret; the deploy scripts make one): "
                             "without it, any client that reaches a decode server can make it read any blocks of a "
                             "prefill server. --allow-unsigned-kv-params serves without one, trusting "
                             "--kv-allowed-peers")
        if self.parallel.ranks_here > 1 and self.model.torch_device.startswith("cuda"):
            self._check_cuda_devices()

    def _check_cuda_devices(self) -> None:
        """A CUDA engine's ranks on its node take one device each, from its own on (NCCL
        refuses two ranks on one device)."""
        import torch

        device, ranks = self.model.torch_device, self.parallel.ranks_here
        first = int(device.partition(":")[2] or 0)
        present = torch.cuda.device_count()
        if first + ranks > present:
            raise ValueError(f"{ranks} tensor-parallel ranks on {device} need CUDA devices "
                             f"{first}..{first + ranks - 1}, one per rank; this machine has {present}")

    @property
    def is_resolved(self) -> bool:
        return AUTO_DTYPE != self.model.dtype and "auto" not in (self.model.quantization, self.cache.memory) \
            and self.transfer.connector != AUTO_CONNECTOR


def _typed(name: str, value: Any) -> Any:
    """A flat value as its group takes it: paths as Path, lists (argparse's) as tuples."""
    if name in ("model", "kv_offload_disk_path") and value is not None:
        return Path(value)
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler takes: its group of the engine's settings, and what the model
    decides (`EngineConfig` does not know it)."""

    settings: SchedulerSettings
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    mamba_block_size: int | None = None  # align prefill chunks to it (Mamba align mode)


@dataclass(frozen=True)
class TierSettings:
    """What the offload tiers (pd/kv_offload) are built with: their group of the engine's
    settings and what the engine decides (its compatibility hash and id)."""

    offload: OffloadSettings
    compat_hash: str
    engine_id: str
