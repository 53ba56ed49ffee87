"""Building blocks shared by the model files: norms, rotary embeddings, fused linears."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pd.distributed.shard import TPShard
from pd.models import fused
from pd.models.parallel import Published, RowParallelLinear, head_rows, tp_reduce


class RMSNorm(nn.Module):
    """RMS norm in float32, as the HF reference computes it. `offset=1.0` is Gemma's
    convention (the stored weight is a delta from 1, applied before casting back).

    `forward(x, residual)` returns `residual + norm(x)` (the norm rounded to x's dtype
    first), in one native pass on CPU (`pd.models.fused`)."""

    def __init__(self, size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size) if offset == 0.0 else torch.zeros(size))
        self.eps = eps
        self.offset = offset
        self._float_weight: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if fused.supports(x) and (residual is None or fused.supports(residual)):
            return fused.rms_norm(x, self.float_weight(), self.eps, residual)
        # The fused kernel accumulates in float32 for 16-bit inputs and rounds once.
        if self.offset:
            out = F.rms_norm(x.float(), self.weight.shape, self.float_weight(), self.eps).to(x.dtype)
        else:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else residual + out

    def float_weight(self) -> torch.Tensor:
        """offset + weight in float32, computed again only when the weight changes (a
        decode step runs ~100 norms: two ops each saved)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._float_weight is None or self._float_weight[0] != key:
            self._float_weight = (key, (self.offset + self.weight.detach().float()).contiguous())
        return self._float_weight[1]


def rope_parameters(hf_config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of a config in either published form: top-level `rope_theta` +
    `rope_scaling` (older configs), or `rope_parameters` (transformers 5), possibly keyed
    by layer type. Returns a dict with at least `rope_theta` and `rope_type`."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    params = dict(params or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _inv_freq(dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3 are)")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE over the first `rotary_dim` dims of each head (rotate-half).

    rotate_half(x) * sin is computed as flip(x as two halves) * [-sin, sin], one copy
    instead of slice/negate/concatenate. cos/sin rows are looked up once per positions
    tensor, so the layers of one forward share them.
    """

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any],
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        if torch.get_default_device().type == "meta":  # a skeleton, shapes only: nothing to compute (computed
            # on meta, each op runs a Python decomposition whose first use imports torch._dynamo: 2 s a process)
            cos, signed_sin = (torch.empty(max_position, self.rotary_dim, dtype=torch.float32) for _ in range(2))
        else:
            inv_freq, scale = _inv_freq(self.rotary_dim, params)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cos, sin = torch.cat((freqs, freqs), dim=-1).cos() * scale, freqs.sin() * scale
            signed_sin = torch.cat((-sin, sin), dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)
        self._rows: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self._checked: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H*D), k (T, KVH*D) -> rotated, same shapes and dtypes."""
        cos, sin = self._lookup(positions, q.dtype)
        return self._rotate_heads(q, cos, sin), self._rotate_heads(k, cos, sin)

    def norm_rotate(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v from the fused projection's output (T, (H + 2 KVH) * D): q and k normed
        per head (when norms are given) and rotated, in one native pass on CPU."""
        size = self.head_size
        q, k, v = qkv.split([num_heads * size, num_kv_heads * size, num_kv_heads * size], dim=-1)
        if (fused.supports(qkv) and qkv.dim() == 2 and self.cos.dtype == torch.float32
                and (q_norm is None) == (k_norm is None) and (q_norm is None or q_norm.eps == k_norm.eps)):
            self._check(positions)
            q, k = fused.qk_norm_rope(qkv, num_heads, num_kv_heads, size,
                                      None if q_norm is None else q_norm.float_weight(),
                                      None if k_norm is None else k_norm.float_weight(),
                                      q_norm.eps if q_norm is not None else 0.0, positions, self.cos, self.signed_sin)
            return q, k, v
        if q_norm is not None:
            q = q_norm(q.reshape(-1, num_heads, size)).flatten(1)
            k = k_norm(k.reshape(-1, num_kv_heads, size)).flatten(1)
        q, k = self(positions, q, k)
        return q, k, v

    def _check(self, positions: torch.Tensor) -> None:
        """Positions index the tables: out of range is an IndexError, as the torch path's
        lookup raises (checked once per positions tensor, which the layers share)."""
        if self._checked is positions:
            return
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < self.cos.shape[0]:
            raise IndexError(f"positions outside [0, {self.cos.shape[0]})")
        self._checked = positions

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None or self._rows[0] is not positions or self._rows[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.signed_sin[positions].unsqueeze(1).to(dtype)
            self._rows = (positions, dtype, cos, sin)
        return self._rows[2], self._rows[3]

    def _rotate_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        if self.rotary_dim < self.head_size:
            rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            return torch.cat((self._rotate(rot, cos, sin), rest), dim=-1).view(shape)
        return self._rotate(x, cos, sin).view(shape)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        halves = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return x * cos + halves * sin


def get_rope(head_size: int, max_position: int, params: dict[str, Any],
             rotary_dim: int | None = None) -> RotaryEmbedding:
    """A RotaryEmbedding shared by every layer (and model) asking for the same one on the
    same device: one cos/sin table, and one lookup per forward instead of one per layer."""
    key = (head_size, max_position, tuple(sorted(params.items())), rotary_dim, str(torch.get_default_device()))
    return _shared_rope(key)


@functools.lru_cache(maxsize=32)
def _shared_rope(key: tuple) -> RotaryEmbedding:
    head_size, max_position, params, rotary_dim, device = key
    return RotaryEmbedding(head_size, max_position, dict(params), rotary_dim).to(device)


class MergedLinear(nn.Linear):
    """One matmul for several published projections (q/k/v, gate/up) stacked on the
    output dim, part i in rows `shard_slice(i)`. Under tensor parallelism it is
    column-parallel: `source_rows[i]` are the rows of published part i (of
    `published_sizes[i]` rows) this rank holds (`pd/models/parallel.py`). Parts load
    from one published weight each, or all from one weight stacking them (Granite's
    input_linear, Mamba's in_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 source_rows: list[slice] | None = None, published_sizes: list[int] | None = None) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = out_sizes
        self.source_rows = source_rows or [slice(0, n) for n in out_sizes]
        self.published_sizes = published_sizes or out_sizes

    def shard_source(self, leaf: str, index: int | None, published: Published) -> torch.Tensor:
        if index is not None:
            return published[self.source_rows[index]]
        starts = [sum(self.published_sizes[:i]) for i in range(len(self.out_sizes))]
        return torch.cat([published[start + rows.start : start + rows.stop]
                          for start, rows in zip(starts, self.source_rows)])

    def shard_slice(self, index: int) -> slice:
        start = sum(self.out_sizes[:index])
        return slice(start, start + self.out_sizes[index])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.out_sizes, dim=-1)


ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise NotImplementedError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)} are)") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused (published names gate_proj/up_proj);
    under tensor parallelism each rank holds a run of the intermediate channels."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False,
                 shard: TPShard = TPShard()) -> None:
        super().__init__()
        first, count = shard.split(intermediate_size, "MLP channels")
        rows = slice(first, first + count)
        self.gate_up_proj = MergedLinear(hidden_size, [count] * 2, bias=bias, source_rows=[rows, rows],
                                         published_sizes=[intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, shard, bias=bias)
        self.act = activation(act)
        self.act_name = act
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_name in fused.ACTIVATIONS and fused.supports(gate_up):
            return tp_reduce(self.down_proj(fused.act_mul(gate_up, self.act_name)), self.shard)
        gate, up = self.gate_up_proj.split(gate_up)
        return tp_reduce(self.down_proj(self.act(gate) * up), self.shard)


def attention_projections(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, shard: TPShard,
                          qkv_bias: bool = False, o_bias: bool = False,
                          ) -> tuple[MergedLinear, RowParallelLinear, int, int]:
    """The fused q/k/v projection and o_proj of this rank's heads, and its numbers of
    query and KV heads: query heads split evenly, KV heads too or replicated when fewer
    than ranks (`TPShard.replicated_split`). o_proj's output is a partial sum
    (`tp_reduce` it)."""
    q_rows = head_rows(shard, num_heads, head_dim)
    kv_rows = head_rows(shard, num_kv_heads, head_dim, replicated=True)
    heads, kv_heads = (q_rows.stop - q_rows.start) // head_dim, (kv_rows.stop - kv_rows.start) // head_dim
    qkv = MergedLinear(hidden, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], bias=qkv_bias,
                       source_rows=[q_rows, kv_rows, kv_rows],
                       published_sizes=[num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    o_proj = RowParallelLinear(num_heads * head_dim, hidden, shard, bias=o_bias, unit=head_dim)
    return qkv, o_proj, heads, kv_heads
