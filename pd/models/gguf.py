"""A `.gguf` file as a model source: config, weights and tokenizer, read with `gguf`.

`--model` may name a GGUF file instead of an HF folder. From the file's metadata come
the architecture and its hyper-parameters (turned into the config.json the HF model
would have) and the tokenizer (transformers' GGUF converter builds a `tokenizers`
tokenizer from the vocabulary, scores and token types; the result is kept on disk, see
`GGUFModel.tokenizer`). The weights are dequantized one tensor at a time with `gguf`'s
dequantizers (F32, F16, BF16, Q4_0..Q8_0, K-quants; Q8_0 in torch, to the same values;
`pd/models/gguf_weights.py`: a rank reads only its rows or columns)
and renamed to the published HF names; the model's `load_weights` casts each into the
serving dtype as it copies it, so at no point is the whole model held in float32.

Families: Gemma 3 (`gemma3`), whose GGUF stores every RMSNorm weight as 1 + w (the HF
checkpoint stores w), and Qwen 3 (`qwen3`), named one to one. Any other architecture is
refused with its name (`UnsupportedGGUF`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pd.models.gguf_weights import GGUFError, GGUFWeight
from telemetry.progress import Progress

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
TOKENIZER_CACHE_ENV = "PD_TOKENIZER_CACHE"


class UnsupportedGGUF(ValueError):
    """A readable GGUF of an architecture this server cannot run."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


# GGUF tensor name (per block: `blk.{i}.` + suffix) -> HF name suffix (`model.layers.{i}.`)
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_LAYER_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_QWEN3_LAYER_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str | Path) -> GGUFModel:
    """The file's GGUFModel, opened once per process (per version of the file): the
    config, the tokenizer and the weights are all read through one parsed header."""
    path = Path(path)
    if not path.is_file():
        return GGUFModel(path)  # says so
    stat = path.stat()
    return _open_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFModel:
    return GGUFModel(path)


class GGUFModel:
    """One GGUF file, memory-mapped; nothing is dequantized until iterated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        from pd.models.gguf_file import GGUFFile  # gguf (numpy) imported only for GGUF models

        try:
            self.reader = GGUFFile(self.path)
        except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
            raise GGUFError(f"{self.path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.architecture = str(self._field("general.architecture", ""))
        self._tokenizer: tuple[str, dict[str, Any]] | None = None  # tokenizer.json text, tokenizer_config
        if self.architecture not in _FAMILIES:
            raise UnsupportedGGUF(f"{self.path}: GGUF architecture {self.architecture or '(none)'!r} is not "
                                  f"supported (supported: {', '.join(sorted(_FAMILIES))})")

    # --- metadata -------------------------------------------------------------------
    def _field(self, key: str, default: Any = None) -> Any:
        return self.reader.fields.get(key, default)

    def _arch(self, key: str, default: Any = None) -> Any:
        value = self._field(f"{self.architecture}.{key}", default)
        if isinstance(value, float):  # stored as float32: 1e-6 reads back 9.99999997e-07
            value = float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
        return value

    def _require(self, key: str) -> Any:
        value = self._arch(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata lacks {self.architecture}.{key}")
        return value

    @cached_property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The config.json of the HF checkpoint these weights come from."""
        return _FAMILIES[self.architecture].config(self)

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        eos = self._field("tokenizer.ggml.eos_token_id")
        return {} if eos is None else {"eos_token_id": int(eos)}

    # --- weights --------------------------------------------------------------------
    def iterate_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) per weight, dequantized one at a time."""
        for name, weight in self.lazy_weights():
            yield name, weight[...]

    def quantized_types(self) -> set[str]:
        """The block types of the file's quantized tensors (Q8_0, Q4_K, ...)."""
        return {t.tensor_type.name for t in self.reader.tensors} - {"F32", "F16", "BF16"}

    def lazy_weights(self) -> Iterator[tuple[str, GGUFWeight]]:
        """(HF name, weight read when indexed) per weight: a tensor-parallel rank reads
        and dequantizes only its rows or columns (`GGUFWeight`)."""
        family = _FAMILIES[self.architecture]
        for tensor in self.reader.tensors:
            name, transform = family.rename(tensor.name)
            if name is not None:
                yield name, GGUFWeight(self.path, tensor, transform)

    # --- tokenizer ------------------------------------------------------------------
    def tokenizer(self) -> tuple[Tokenizer, dict[str, Any]]:
        """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF's vocabulary.
        Converting Gemma 3's 262k tokens takes ~3.7 s, so the result is kept twice: per
        GGUFModel (open_gguf keeps one per file and process), and on disk under
        `$PD_TOKENIZER_CACHE` (default `~/.cache/pd-tokenizers`), keyed by the file
        (path, size, mtime), this module's source and the converter's versions, so that
        the servers of a deployment convert once. Each call gets its own copy (0.75 s)."""
        from tokenizers import Tokenizer

        if self._tokenizer is None:
            self._tokenizer = self._cached_tokenizer()
        text, config = self._tokenizer
        return Tokenizer.from_str(text), dict(config)

    def _cached_tokenizer(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, tokenizer_config) from the disk cache, else converted and
        written there (aside, then renamed in). Processes that miss the cache together (a
        deployment's servers starting at once) take turns through a lock file beside it:
        the first converts, the others then read what it wrote. A cache that cannot be
        read or written costs a conversion, nothing else."""
        path = _tokenizer_cache_path(self.path)
        cached = _read_tokenizer_cache(path)
        if cached is None:
            with _cache_lock(path):
                cached = _read_tokenizer_cache(path) or self._convert_and_keep(path)
        return cached

    def _convert_and_keep(self, path: Path) -> tuple[str, dict[str, Any]]:
        tokenizer, config = self._convert_tokenizer()
        text = tokenizer.to_str()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as aside:
                written = Path(aside) / path.name
                written.write_text(json.dumps({"tokenizer": text, "config": config}))
                os.replace(written, path)
        except (OSError, TypeError) as exc:
            logger.warning("could not keep the converted tokenizer in %s (%s)", path.parent, exc)
        return text, config

    def _convert_tokenizer(self):
        from tokenizers import processors
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(self.path))
        tokenizer, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        tokenizer_config = {**tokenizer_config, **extra}
        template = self._field("tokenizer.chat_template")
        if template:
            tokenizer_config["chat_template"] = str(template)
        bos = tokenizer_config.get("bos_token")
        if tokenizer_config.get("add_bos_token") and bos:  # the converter's post-processor adds nothing
            bos_id = tokenizer.token_to_id(bos)
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        return tokenizer, tokenizer_config

    # --- conversion -----------------------------------------------------------------
    def write_hf_folder(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
        """config.json, generation_config.json, model.safetensors (weights in `dtype`),
        tokenizer.json and tokenizer_config.json: an HF checkpoint transformers loads. The
        progress per tensor dequantized goes to stderr (`telemetry.progress`)."""
        import torch
        from safetensors.torch import save_file

        dtype = dtype or torch.float32
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        lazy = list(self.lazy_weights())
        with Progress("converting weights", len(lazy), "tensors") as progress:
            weights = {name: weight[...].to(dtype) for name, weight in progress.track(lazy)}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        del weights
        config = {**self.hf_config, "torch_dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2) + "\n")
        tokenizer, tokenizer_config = self.tokenizer()
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {**tokenizer_config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
        return out


def _read_tokenizer_cache(path: Path) -> tuple[str, dict[str, Any]] | None:
    """(tokenizer.json text, tokenizer_config) kept at `path`; None if it is not there or
    does not read (then it is converted again and rewritten)."""
    try:
        cached = json.loads(path.read_text())
        return cached["tokenizer"], cached["config"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the unreadable tokenizer cache %s (%s)", path, exc)
        return None


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on PATH.lock for the block (the kernel drops it if its holder
    dies); no lock where the folder cannot be written (each process then converts)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115  (closed below: that unlocks it)
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _tokenizer_cache_path(gguf_path: Path) -> Path:
    from importlib.metadata import version

    stat = gguf_path.stat()
    key = hashlib.sha256("\0".join([
        str(gguf_path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), Path(__file__).read_text(),
        version("transformers"), version("tokenizers")]).encode()).hexdigest()
    cache = Path(os.environ.get(TOKENIZER_CACHE_ENV) or Path.home() / ".cache" / "pd-tokenizers")
    return cache / f"{gguf_path.stem}-{key[:16]}.json"


class _Family:
    def __init__(self, config: Callable[[GGUFModel], dict[str, Any]], layer_norms: dict[str, str],
                 norm_offset: float) -> None:
        self.config = config
        self.layer_norms = layer_norms
        self.norm_offset = norm_offset  # GGUF stores norm weights as this + the HF weight

    def rename(self, gguf_name: str) -> tuple[str | None, Callable[[torch.Tensor], torch.Tensor] | None]:
        """(HF name, transform or None); (None, None) for tensors the HF model has no use for."""
        is_norm = False
        if gguf_name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[gguf_name]
            is_norm = gguf_name == "output_norm.weight"
        elif gguf_name.startswith("blk."):
            _, index, suffix = gguf_name.split(".", 2)
            if suffix in self.layer_norms:
                name, is_norm = f"model.layers.{index}.{self.layer_norms[suffix]}", True
            elif suffix in _LAYER_NAMES:
                name = f"model.layers.{index}.{_LAYER_NAMES[suffix]}"
                is_norm = suffix.endswith("_norm.weight")
            else:
                return None, None
        else:
            return None, None
        if is_norm and self.norm_offset:
            return name, lambda t: t - self.norm_offset
        return name, None


def _common_config(m: GGUFModel) -> dict[str, Any]:
    """The hyper-parameters every family's GGUF metadata names alike."""
    heads = int(m._require("attention.head_count"))
    hidden = int(m._require("embedding_length"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(m._require("feed_forward_length")),
        "num_hidden_layers": int(m._require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m._arch("attention.head_count_kv", heads)),
        "head_dim": int(m._arch("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(m._arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m._arch("rope.freq_base", 1_000_000.0)),
        "max_position_embeddings": int(m._arch("context_length", 32768)),
        "vocab_size": len(m._field("tokenizer.ggml.tokens", [])) or int(m._require("vocab_size")),
        "tie_word_embeddings": "output.weight" not in m.tensor_names,
    } | _special_ids(m)


def _gemma3_config(m: GGUFModel) -> dict[str, Any]:
    config = _common_config(m) | {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "rope_local_base_freq": 10_000.0,  # not in the GGUF; every Gemma 3 uses it
        "sliding_window": int(m._arch("attention.sliding_window", 4096)),
        "sliding_window_pattern": 6,  # five sliding layers to one full, in every Gemma 3
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    config["query_pre_attn_scalar"] = config["head_dim"]  # as llama.cpp and transformers read Gemma 3 GGUFs
    scaling = m._arch("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": str(scaling), "factor": float(m._arch("rope.scaling.factor", 1.0))}
    return config


def _qwen3_config(m: GGUFModel) -> dict[str, Any]:
    return _common_config(m) | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu"}


def _special_ids(m: GGUFModel) -> dict[str, Any]:
    ids = {}
    for key in ("bos", "eos", "pad"):
        value = m._field(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            ids[f"{key}_token_id"] = int(value)
    return ids


_FAMILIES = {
    "gemma3": _Family(_gemma3_config, _GEMMA3_LAYER_NORMS, norm_offset=1.0),
    "qwen3": _Family(_qwen3_config, _QWEN3_LAYER_NORMS, norm_offset=0.0),
}
