"""ModelConfig: a checkpoint directory's config.json and the choices made serving it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pd.distributed.shard import TPShard

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
AUTO_DTYPE = "auto"


GGUF_KERNEL_TYPES = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")  # block types pd.models.gguf_linear computes from


def resolve_dtype(model: str | Path, requested: str, device: str | Callable[[], str]) -> tuple[str, str]:
    """(dtype, why) for serving `model` on `device`. A named dtype is itself; `auto` is the
    checkpoint's own dtype (`torch_dtype` / `dtype` in config.json) for an HF folder, and
    for a GGUF file (quantized: no dtype of its own) bfloat16 where the device computes in
    it natively, else float32. `device` may be a function: called (it may import torch)
    only for a GGUF file."""
    if requested != AUTO_DTYPE:
        return requested, "as asked"
    from pd.models.gguf import is_gguf

    if is_gguf(model):
        if _bfloat16_native(device() if callable(device) else device):
            return "bfloat16", "auto: a quantized GGUF, on a device with native bfloat16"
        return "float32", "auto: a quantized GGUF, on a device without native bfloat16"
    config_path = Path(model) / "config.json"
    if not config_path.is_file():  # loading the model says what is wrong with it
        return "float32", "auto: no config.json to read"
    config = json.loads(config_path.read_text())
    for source in (config, config.get("text_config") or {}):
        declared = source.get("torch_dtype") or source.get("dtype")
        if declared in SUPPORTED_DTYPES:
            return declared, "auto: the checkpoint's dtype"
    return "float32", "auto: the checkpoint names no dtype"


def resolve_quantization(model: str | Path, dtype: str, device: Callable[[], str], tp: int) -> tuple[str, str]:
    """(quantization, why) for `--quantization auto`: gguf where the model is a quantized
    GGUF served in bfloat16 by one CPU rank that has the kernels (AVX-512 VNNI and a C
    compiler: pd.models.gguf_linear), none otherwise. float32 is left unquantized: who asks
    for it asks for exact arithmetic."""
    from pd.models.gguf import is_gguf, open_gguf

    if not is_gguf(model):
        return "none", "auto: not a GGUF file"
    try:
        types = open_gguf(model).quantized_types()
    except (OSError, ValueError):  # loading the model says what is wrong with it
        return "none", "auto: the GGUF could not be read"
    if not types & set(GGUF_KERNEL_TYPES):
        return "none", f"auto: the GGUF holds none of {', '.join(GGUF_KERNEL_TYPES)}"
    if dtype != "bfloat16":
        return "none", f"auto: dtype {dtype} (gguf computes in bfloat16)"
    if tp != 1:
        return "none", "auto: tensor parallelism (gguf kernels serve one rank)"
    if not device().startswith("cpu"):
        return "none", "auto: not a CPU (gguf kernels are CPU kernels)"
    from pd import native

    if not native.can_build() or not native.cpu_has("avx512_vnni"):
        return "none", "auto: this CPU has no AVX-512 VNNI or no C compiler (gguf would be slower than bfloat16)"
    return "gguf", "auto: a quantized GGUF on a CPU with the kernels"


def _bfloat16_native(device: str) -> bool:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16", "bf16"))  # x86; Arm's flag is bf16


@dataclass(frozen=True)
class ModelConfig:
    """`hf_config` is config.json as published (for a `.gguf` file: as its metadata
    describes it); `dtype` the weights' and KV cache's dtype name; `max_model_len`
    defaults to the model's `max_position_embeddings`. `model_dir` is the HF folder or
    the GGUF file. `tp`: the tensor-parallel share of the model to build (all of it by
    default)."""

    model_dir: Path
    hf_config: dict[str, Any]
    dtype: str = "float32"
    max_model_len: int | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    tp: TPShard = TPShard()
    kv_cache_dtype: str | None = None  # attention layers' KV dtype name where not `dtype` (--kv-cache-dtype)

    @property
    def attention_kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if not self.architectures:
            raise ValueError(f"{self.model_dir}/config.json names no `architectures`")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str = "float32", max_model_len: int | None = None,
                 tp: TPShard = TPShard(), kv_cache_dtype: str | None = None) -> "ModelConfig":
        model_dir = Path(model_dir)
        from pd.models.gguf import is_gguf, open_gguf

        if is_gguf(model_dir):  # a GGUF file: its metadata makes the config.json
            gguf = open_gguf(model_dir)
            return cls(model_dir, dict(gguf.hf_config), dtype, max_model_len, dict(gguf.generation_config), tp,
                       kv_cache_dtype)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory: no config.json")
        hf_config = json.loads(config_path.read_text(), object_hook=_decode_float)
        hf_config = hf_config.get("text_config", hf_config) | {"architectures": hf_config.get("architectures")}
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls(model_dir, hf_config, dtype, max_model_len, gen, tp, kv_cache_dtype)

    @property
    def architectures(self) -> list[str]:
        return list(self.hf_config.get("architectures") or [])

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf_config.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        """A config.json value the model cannot do without; ValueError naming it if absent."""
        value = self.hf_config.get(key)
        if value is None:
            raise ValueError(f"{self.model_dir}/config.json lacks {key!r}")
        return value

    @property
    def vocab_size(self) -> int:
        return self.require("vocab_size")

    @property
    def context_len(self) -> int:
        """The longest sequence served: `max_model_len`, else the model's limit."""
        return self.max_model_len or self.get("max_position_embeddings", 2048)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids from generation_config.json and config.json."""
        ids: set[int] = set()
        for source in (self.generation_config, self.hf_config):
            value = source.get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
        return frozenset(ids)


def _decode_float(obj: dict[str, Any]) -> Any:
    """transformers 5 writes infinities in config.json as {"__float__": "Infinity"}."""
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])  # float() parses "Infinity", "-Infinity", "NaN"
    return obj
