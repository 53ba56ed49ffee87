"""All of a Gemma 3 step's decoder layers in one native call (`pd/csrc/decoder.c`).

The native layer plans (`pd.models.native_layers`) still spend Python between their kernels:
~12 calls a layer, each making its output tensor and converting its arguments through
ctypes (Gemma 3 270M: ~220 calls a step). `NativeDecoder` runs the same kernels in the
same order on the same inputs from C, reached through function pointers read once from
their libraries, so it computes the plans' bytes (tested, bitwise) with one ctypes call a
step. It is built where every layer is what it was written for: GGUF linears on the native
kernel without a bias (`SegmentsCall`), the native paged attention over a KV cache of the
model's dtype, one shape for all layers. A step it cannot take (another cache dtype, a
metadata it does not know) returns None and runs on the plans.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pd import native
from pd.attention import cpu_kernels
from pd.attention.torch_backend import TorchAttentionImpl, TorchAttentionMetadata
from pd.forward_context import get_forward_context
from pd.models import fused
from pd.models.gguf_linear import SegmentsCall
from pd.models.native_layers import LayerPlan

SOURCE = Path(__file__).parent.parent / "csrc" / "decoder.c"
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_STAGES = {1: "qkv projection", 2: "q/k norm and rope", 3: "KV write", 4: "attention", 5: "o projection",
           6: "gate/up projection", 7: "activation", 8: "down projection", 9: "norm"}


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("rms_norm", "qk_norm_rope", "act_mul", "segments", "write_kv",
                                          "attention")]


class _Linear(ctypes.Structure):
    _fields_ = [("in_features", _I64), ("out_features", _I64), ("n_seg", _I64),
                *((name, _PTR) for name in ("weights", "n_out", "bs", "scales", "bits", "first"))]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("norm", _PTR * 4), ("eps", _F32 * 4), ("q_norm", _PTR), ("k_norm", _PTR), ("qk_eps", _F32),
                ("cos", _PTR), ("sin", _PTR), ("rot", _I64), ("table_rows", _I64), ("cache", _PTR),
                ("cache_strides", _I64 * 4), ("group", _I64), ("window", _I64), ("scale", _F32)]


class _Group(ctypes.Structure):
    _fields_ = [("table", _PTR), ("table_cols", _I64), ("table_rows", _I64), ("tiles", _PTR), ("n_tiles", _I64),
                ("max_tile", _I64), ("max_span", _I64), ("slot_blocks", _PTR), ("slot_offsets", _PTR),
                ("scratch", _PTR)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_size", "inter", "act",
                                          "block_size", "element_size")]


_BUFFERS = ("h", "qkv", "q", "k", "a", "o", "x1", "g", "m", "d", "out")


class _Buffers(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in _BUFFERS]


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.load(SOURCE, {"decoder_layers": [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64]})


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, _PTR).value


def _linear(module: torch.nn.Module) -> _Linear | None:
    call = getattr(module, "gguf_call", None)
    if not isinstance(call, SegmentsCall) or getattr(module, "bias_f32", None) is not None:
        return None
    return _Linear(call.in_features, call.out_features, len(call.packed), ctypes.addressof(call.weights),
                   call.n_out.data_ptr(), call.bs.data_ptr(), call.scales.data_ptr(), call.bits.data_ptr(),
                   call.first.data_ptr())


class NativeDecoder:
    """The layers of `plans` (one per decoder layer, in order) as one native call; `build`
    returns None where a layer is not what `decoder.c` runs."""

    def __init__(self, plans: list[LayerPlan], linears: list[list[_Linear]], dtype: torch.dtype) -> None:
        first = plans[0]
        self.plans, self.dtype = plans, dtype
        suffix = _SUFFIX[dtype]
        attention = cpu_kernels._library()
        self.kernels = _Kernels(*(_address(getattr(fused._library(), f"{name}_{suffix}"))
                                  for name in ("rms_norm", "qk_norm_rope", "act_mul")),
                                _address(first.qkv.gguf_call.functions[dtype]), _address(attention.write_kv_rows),
                                _address(getattr(attention, f"paged_attention_{suffix}")))
        self.hidden = first.down.out_features
        self.inter = first.down.in_features
        self.shape = _Shape(self.hidden, first.heads, first.kv_heads, first.head_size, self.inter,
                            fused.ACTIVATIONS[first.activation], 0, dtype.itemsize)
        self.layers = (_Layer * len(plans))()
        self.linears = linears
        self.bound: list[tuple | None] = [None] * len(plans)  # what layer i's entry points into
        self.ropes = list({id(plan.rope): plan.rope for plan in plans}.values())  # layers of a kind share one
        self.widths = {"h": self.hidden, "qkv": (first.heads + 2 * first.kv_heads) * first.head_size,
                       "q": first.heads * first.head_size, "k": first.kv_heads * first.head_size,
                       "a": first.heads * first.head_size, "o": self.hidden, "x1": self.hidden,
                       "g": 2 * self.inter, "m": self.inter, "d": self.hidden}

    @classmethod
    def build(cls, plans: list[LayerPlan], dtype: torch.dtype) -> NativeDecoder | None:
        if not plans or dtype not in _SUFFIX or _library() is None or not cpu_kernels.build():
            return None
        first, linears = plans[0], []
        hidden, inter, size = first.down.out_features, first.down.in_features, first.head_size
        kind = (first.heads, first.kv_heads, size, first.activation)
        shapes = [(hidden, (first.heads + 2 * first.kv_heads) * size), (first.heads * size, hidden),
                  (hidden, 2 * inter), (inter, hidden)]  # qkv, o, gate/up, down: (in, out)
        for plan in plans:
            modules = (plan.qkv, plan.o, plan.gate_up, plan.down)
            four = [_linear(m) for m in modules]
            if (not all(four) or not isinstance(plan.attn.impl, TorchAttentionImpl)
                    or (plan.heads, plan.kv_heads, plan.head_size, plan.activation) != kind
                    or [(m.in_features, m.out_features) for m in modules] != shapes):
                return None
            linears.append(four)
        return cls(plans, linears, dtype)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The last layer's output for hidden states x (tokens, hidden) of the decoder's
        dtype, contiguous, at positions (tokens,) int64 contiguous; None where this step's
        caches or metadata are not what the call takes (the plans run it then)."""
        context, tokens = get_forward_context(), x.shape[0]
        groups, group_of = [], {}
        for i, plan in enumerate(self.plans):
            name = plan.attn.layer_name
            cache, metadata = context.kv_caches[name].kv, context.attn_metadata[name]
            if not self._bind(i, plan, cache):
                return None
            if id(metadata) not in group_of:
                group = self._group(metadata, plan, tokens)
                if group is None:
                    return None
                group_of[id(metadata)] = len(groups)
                groups.append(group)  # (its entry, its scratch): held through the call
            if metadata.sliding_window != plan.attn.impl.sliding_window:
                return None
            self.layers[i].group = group_of[id(metadata)]
        for rope in self.ropes:
            rope._check(positions)  # an IndexError as the module path raises (the kernel refuses too)
        steps = (_Group * len(groups))(*(g for g, _ in groups))
        flat = torch.empty(tokens * sum(self.widths.values()), dtype=self.dtype)
        out = torch.empty(tokens, self.hidden, dtype=self.dtype)
        pointers, at = [], flat.data_ptr()
        for width in self.widths.values():  # end to end in flat
            pointers.append(at)
            at += tokens * width * self.shape.element_size
        buffers = _Buffers(*pointers, out.data_ptr())
        status = _library().decoder_layers(ctypes.addressof(self.kernels), ctypes.addressof(self.shape),
                                           ctypes.addressof(self.layers), len(self.plans), ctypes.addressof(steps),
                                           x.data_ptr(), positions.data_ptr(), tokens, ctypes.addressof(buffers),
                                           torch.get_num_threads())
        if status:
            raise ValueError(f"native decoder: layer {status // 16 - 1}'s {_STAGES.get(status % 16, 'kernel')} "
                             "refused its arguments")
        return out

    def _bind(self, i: int, plan: LayerPlan, cache: torch.Tensor) -> bool:
        """Layer i's entry for this cache view and these norm weights (`float_weight` makes
        them again when a weight changes), or False where the call cannot take the cache."""
        norms = plan.norms
        weights = (*(n.float_weight() for n in norms), plan.q_norm.float_weight(), plan.k_norm.float_weight())
        now = (cache, plan.rope.cos, plan.rope.signed_sin, *weights)
        if self.bound[i] is not None and all(a is b for a, b in zip(now, self.bound[i], strict=True)):
            return True
        if cache.dtype != self.dtype or not cpu_kernels.supports(cache) or cache.dim() != 5 \
                or cache.shape[3:] != (plan.kv_heads, plan.head_size):
            return False
        if self.shape.block_size not in (0, cache.shape[2]):
            return False
        self.shape.block_size = cache.shape[2]
        qw, kw = weights[4:]
        self.layers[i] = _Layer(*self.linears[i], (_PTR * 4)(*(w.data_ptr() for w in weights[:4])),
                                (_F32 * 4)(*(n.eps for n in norms)), qw.data_ptr(), kw.data_ptr(), plan.q_norm.eps,
                                plan.rope.cos.data_ptr(), plan.rope.signed_sin.data_ptr(), plan.rope.cos.shape[-1],
                                plan.rope.cos.shape[0], cache.data_ptr(), (_I64 * 4)(*cache.stride()[:4]), 0,
                                plan.attn.impl.sliding_window or 0, plan.attn.impl.scale)
        self.bound[i] = now
        return True

    def _group(self, metadata: TorchAttentionMetadata, plan: LayerPlan, tokens: int
               ) -> tuple[_Group, torch.Tensor] | None:
        """The group's entry for this step (and its scratch, to hold through the call), or
        None where the call cannot take its metadata."""
        if metadata.num_actual_tokens != tokens or not tokens:
            return None
        tiles = metadata.tiles
        if not tiles.tiles.numel():
            return None
        group = plan.heads // plan.kv_heads
        size = cpu_kernels.scratch_size(group * tiles.max_tile, plan.head_size, tiles.max_span)
        scratch = metadata.workspace.take("scratch", (size,), torch.float32, torch.device("cpu"))
        blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        if not (blocks.is_contiguous() and offsets.is_contiguous()):
            return None
        return _Group(tiles.table.data_ptr(), tiles.table.shape[1], tiles.table.shape[0], tiles.tiles.data_ptr(),
                      tiles.tiles.shape[0], tiles.max_tile, tiles.max_span, blocks.data_ptr(), offsets.data_ptr(),
                      scratch.data_ptr()), scratch
