"""What every model offers the model runner, and the shared weight loading."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pd.kv_cache.spec import KVCacheSpec
from pd.models.layers import MergedLinear
from pd.models.model_config import ModelConfig
from pd.models.parallel import Published, narrow_published

# (fused parameter, published name, shard index): published q/k/v and gate/up weights
# load into slices of one fused matmul.
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class CausalLM(nn.Module):
    """A decoder-only LM over the paged KV cache.

    `forward(input_ids (T,), positions (T,)) -> hidden (T, hidden)` runs the batch's new
    tokens (requests concatenated) inside a forward context (`pd/forward_context.py`);
    `compute_logits` maps chosen hidden rows to logits in the model's dtype (a greedy
    argmax needs no float32 copy of a vocabulary-wide row; whoever needs float32
    widens). Layers that keep state (attention, Mamba) are returned by `kv_cache_layers`
    under their KV cache layer name.
    """

    stacked_params: tuple[tuple[str, str, int], ...] = STACKED_PARAMS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # parameter name -> (output rows, block type, raw blocks) per part loaded whole from
        # a quantized GGUF tensor: what `--quantization gguf` computes from (pd.models.gguf_linear)
        self.gguf_sources: dict[str, list[tuple[slice, str, object]]] = {}

    def kv_cache_layers(self) -> dict[str, nn.Module]:
        """Layer name -> the module owning that layer's KV cache, in layer order."""
        raise NotImplementedError

    def kv_cache_specs(self, block_size: int, hybrid: bool = True) -> dict[str, KVCacheSpec]:
        """Every stateful layer's spec, in layer order. `hybrid=False` puts every attention
        layer in full attention; a model with Mamba layers refuses it (see overrides)."""
        dtype = self.config.attention_kv_dtype
        return {name: layer.kv_cache_spec(block_size, dtype, hybrid=hybrid)
                for name, layer in self.kv_cache_layers().items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def map_weight_name(self, name: str) -> str | None:
        """The parameter name for a published weight name; None to skip the weight."""
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy published weights into the parameters; raises if any parameter is left
        unloaded or a weight matches no parameter."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}
        for published, tensor in weights:
            name = self.map_weight_name(published)
            if name is None:
                continue
            param_name, shard = self._load_one(params, name, tensor)
            if shard is None:
                loaded.add(param_name)
            else:
                shards.setdefault(param_name, set()).add(shard)
        for param_name, got in shards.items():
            module = self.get_submodule(param_name.rsplit(".", 1)[0])
            if len(got) == len(module.out_sizes):  # a fused weight is loaded once every shard is
                loaded.add(param_name)
        if self.tie_word_embeddings and "lm_head.weight" in params:
            loaded.add("lm_head.weight")  # shares the embedding's storage
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint {self.config.model_dir} lacks weights for: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    def _load_one(self, params: dict[str, nn.Parameter], name: str,
                  tensor: Published) -> tuple[str, int | None]:
        """Copy this rank's part of one weight (`narrow_published`); returns the parameter
        name and the shard index if fused."""
        for fused, published, shard in self.stacked_params:
            if f".{published}." in name:
                fused_name = name.replace(f".{published}.", f".{fused}.")
                if fused_name in params:
                    module_name, leaf = fused_name.rsplit(".", 1)
                    module = self.get_submodule(module_name)
                    assert isinstance(module, MergedLinear)
                    part = narrow_published(module, leaf, shard, tensor)
                    _copy(params[fused_name].data[module.shard_slice(shard)], part, published)
                    self._note_source(fused_name, module.shard_slice(shard), tensor)
                    return fused_name, shard
        if name not in params:
            raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(self).__name__}")
        module_name, leaf = name.rsplit(".", 1)
        _copy(params[name].data, narrow_published(self.get_submodule(module_name), leaf, None, tensor), name)
        self._note_source(name, slice(0, params[name].shape[0]), tensor)
        return name, None

    def _note_source(self, name: str, rows: slice, tensor: Published) -> None:
        raw = getattr(tensor, "raw_blocks", None)
        found = raw() if raw is not None and self.config.tp.size == 1 else None
        if found is not None:
            self.gguf_sources.setdefault(name, []).append((rows, *found))


def _copy(dst: torch.Tensor, src: Published, name: str) -> None:
    src = src if isinstance(src, torch.Tensor) else src[...]  # a lazy slice read whole: not sharded
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))
