"""`--quantization gguf`: linear layers computed from the GGUF file's own quantized blocks.

A quantized GGUF is otherwise dequantized at load, and a bfloat16 decode step reads 2.2x
the weight bytes the file needs (Gemma 3 270M: 536 MB a step against 247 MB). Here each
linear weight whose tensor is Q8_0, Q5_0, Q4_K or Q6_K keeps its quantized values, unpacked
once at load into values and their blocks' scales (`Blocks`: w = a u + c per block, bitwise
gguf's dequantized values) and repacked in the type's own bits (`pack`: bytes, or nibbles
and bit planes), and `pd/csrc/gguf_linear.c` multiplies from them
with the activations quantized as llama.cpp quantizes them for that type (Q8_0 rows, per 32
inputs, for Q8_0 and Q5_0; Q8_K rows, per 256, for Q4_K and Q6_K): int8 products summed
exactly, scaled per block, so that the file computes as llama.cpp computes it. The tied
embedding's table serves the lm_head so (Q8_0 on Gemma).

Which weights: a linear whose every part (a fused q/k/v or gate/up has three or two) came
whole from one GGUF tensor of those types with no transform (`CausalLM.gguf_sources`);
the others (float tensors, other block types, a tensor-parallel shard) stay bfloat16,
packed for oneDNN (`pd.models.packed`). With their scales Q5_0 takes 0.69 bytes a weight,
Q4_K 0.59, Q6_K 0.83 and Q8_0 1.06 (as the file: 0.69, 0.56, 0.82, 1.06; the K-quants'
integer scales kept as integers): 247.2 MB a step on Gemma against the file's 246.4 and
bfloat16's 536.

On CPU with the native kernel built the kernel computes it; elsewhere (`PD_NATIVE_KERNELS=0`,
another device) `reference` does the same arithmetic in torch: the activations quantized
alike, a float32 matmul with the dequantized weight. The two agree to float32 summation
order.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import types
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pd import native
from pd.huge_pages import into_huge_pages
from pd.models.model_config import GGUF_KERNEL_TYPES
from pd.models.quantized import check_status, native_rows

logger = logging.getLogger(__name__)

SOURCE = native.SOURCES / "gguf_linear.c"
TILE = 32  # output channels per packed tile (gguf_linear.c)
XBLOCK = 32  # inputs per activation scale
KBLOCK = 256  # inputs per K-quant super-block, and per activation scale of its weight (llama.cpp's Q8_K)
TYPES = GGUF_KERNEL_TYPES  # the block types computed from
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_I64, _PTR = native.I64, native.PTR
_LINEAR_ARGS = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64]
_SEGMENTS_ARGS = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64]


@functools.cache
def _library(plain: bool = False) -> ctypes.CDLL | None:
    """The kernels; `plain` builds the plain C path (no VNNI) for the tests."""
    signatures = {f"gguf_linear_{suffix}": _LINEAR_ARGS for suffix in _SUFFIX.values()}
    signatures |= {f"gguf_segments_{suffix}": _SEGMENTS_ARGS for suffix in _SUFFIX.values()}
    signatures["gguf_quantize_rows"] = [_PTR, _I64, _I64, _I64, _PTR, _PTR]
    return native.load(SOURCE, signatures, defines=("PD_PLAIN",) if plain else ())


@dataclass
class Blocks:
    """One weight's blocks unpacked: w[n][bs b + i] = a[n][b] u[n][bs b + i] + c[n][b], with
    c = -128 a where `c` is None (symmetric types). A K-quant's a and c come from integers
    per block and float16 scales per super-block of 256 inputs: a = d sc, c = -dmin m."""

    u: torch.Tensor  # (N, K) uint8
    a: torch.Tensor  # (N, K / bs) float32
    c: torch.Tensor | None  # (N, K / bs) float32, Q4_K's minimums
    bs: int  # inputs per block: 32, or 16 for Q6_K
    bits: int  # the type's bits a value: 8 (Q8_0), 5 (Q5_0), 4 (Q4_K), 6 (Q6_K)
    sc: torch.Tensor | None = None  # K-quants: (N, K / bs) int8
    d: torch.Tensor | None = None  # K-quants: (N, K / 256) float32
    m: torch.Tensor | None = None  # Q4_K: (N, K / bs) int8
    dmin: torch.Tensor | None = None  # Q4_K: (N, K / 256) float32

    @property
    def scales(self) -> int:
        """The kernel's scale format: 2 a as float16 (Q8_0 and Q5_0, whose a is the file's
        float16 d); 0 sc as int8, d per super-block (Q6_K); 1 sc and m as int8, d and -dmin
        per super-block (Q4_K)."""
        return 1 if self.c is not None else 0 if self.bits == 6 else 2

    @property
    def stored(self) -> torch.Tensor:
        """The values as packed: u (8 bits, or Q4_K's q), or a symmetric type's q = u - (128 - z),
        z = 2^(bits - 1), in `bits` bits (gguf_linear.c)."""
        if self.bits == 8 or self.c is not None:
            return self.u
        return self.u - (128 - (1 << (self.bits - 1)))

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, bitwise the values gguf's dequantizer gives."""
        a = self.a.repeat_interleave(self.bs, dim=1)
        if self.c is None:
            return a * (self.u.to(torch.int32) - 128).float()
        return a * self.u.float() + self.c.repeat_interleave(self.bs, dim=1)


def unpack(kind: str, raw: np.ndarray) -> Blocks:
    """A GGUF tensor's rows of raw blocks ((N, bytes per row) uint8) as `Blocks`."""
    n = raw.shape[0]
    if kind == "Q8_0":  # per 32: float16 d, 32 int8 (in torch: the lm_head's 168M values, on every thread)
        with warnings.catch_warnings():  # the file's read-only map: only read here
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw).view(n, -1, 34)
        d = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]
        u = blocks[..., 2:].bitwise_xor(0x80)  # int8 q -> q + 128
        return Blocks(u.reshape(n, -1), d.contiguous(), None, 32, 8)
    if kind == "Q5_0":  # per 32: float16 d, 32 high bits, 16 bytes of low nibbles
        blocks = raw.reshape(n, -1, 22)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit j: element j
        low = np.concatenate([blocks[..., 6:] & np.uint8(0x0F), blocks[..., 6:] >> np.uint8(4)], axis=-1)
        u = (low | (high << np.uint8(4))) + np.uint8(112)  # q - 16 + 128
        return Blocks(_tensor(u.reshape(n, -1)), _tensor(d), None, 32, 5)
    if kind == "Q4_K":  # per 256: float16 d, dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        nibbles = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        u = (nibbles & np.uint8(0x0F)).reshape(n, -1)
        return _k_quant(n, u, sc, d, 32, 4, m, dmin)
    if kind == "Q6_K":  # per 256: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, float16 d
        blocks = raw.reshape(-1, 210)
        low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = (low & np.uint8(0x0F)).reshape(-1, 8, 32) | ((high & np.uint8(0x03)).reshape(-1, 8, 32) << np.uint8(4))
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        return _k_quant(n, q + np.uint8(96), blocks[:, 192:208].view(np.int8), d, 16, 6)
    raise ValueError(f"no GGUF kernel for block type {kind}")


def _k_quant(n: int, u: np.ndarray, sc: np.ndarray, d: np.ndarray, bs: int, bits: int,
             m: np.ndarray | None = None, dmin: np.ndarray | None = None) -> Blocks:
    """A K-quant's `Blocks` from its super-blocks' integer scales (sc, m: one row of blocks
    per super-block) and float32 d, dmin ((super-blocks, 1)): a = d sc, c = -dmin m."""
    def rows(x: np.ndarray) -> torch.Tensor:
        return _tensor(x.reshape(n, -1))

    a = rows(d * sc.astype(np.float32))
    if m is None:
        return Blocks(rows(u), a, None, bs, bits, sc=rows(sc.astype(np.int8)), d=rows(d))
    return Blocks(rows(u), a, rows(-(dmin * m.astype(np.float32))), bs, bits, sc=rows(sc.astype(np.int8)), d=rows(d),
                  m=rows(m.astype(np.int8)), dmin=rows(dmin))


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def pack(blocks: Blocks) -> torch.Tensor:
    """The kernel's layout (gguf_linear.c): per tile of 32 channels, per block, the values
    ([group][channel][4] bytes, or below 8 bits nibbles of group pairs and their high bit
    planes), then the channels' scales in the format `Blocks.scales` names: a (Q8_0, Q5_0),
    or sc (then m) and, after each super-block's last block, d (then -dmin)."""
    n, k = blocks.u.shape
    tiles, nb, bs = -(-n // TILE), k // blocks.bs, blocks.bs
    pad = tiles * TILE - n

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # (N, per channel) -> (tiles, each, 32 channels) as bytes
        return padded(t).view(tiles, TILE, -1).transpose(1, 2).contiguous().view(torch.uint8)

    groups = padded(blocks.stored).view(tiles, TILE, nb, bs // 4, 4).permute(0, 2, 3, 1, 4).reshape(
        tiles, nb, bs // 4, 128)
    if blocks.bits == 8:
        parts = [groups.reshape(tiles, nb, bs * TILE)]
    else:
        low, high = groups[:, :, 0::2], groups[:, :, 1::2]  # group 2p and 2p + 1 share pair p's bytes
        parts = [((low & 0x0F) | ((high & 0x0F) << 4)).reshape(tiles, nb, bs * TILE // 2)]
        pairs = groups.view(tiles, nb, bs // 8, 256).numpy()  # bit h * 128 + i of a pair: group 2p + h, byte i
        for plane in range(blocks.bits - 4):
            bits = (pairs >> (4 + plane)) & 1
            parts.append(_tensor(np.packbits(bits, axis=-1, bitorder="little")).reshape(tiles, nb, bs * TILE // 8))
    if blocks.scales == 2:
        half = blocks.a.to(torch.float16)
        assert torch.equal(half.float(), blocks.a), "a float16 scale format for scales float16 cannot hold"
        parts.append(by_tile(half))
        return torch.cat(parts, dim=2).reshape(-1)
    parts += [by_tile(blocks.sc)] + ([by_tile(blocks.m)] if blocks.m is not None else [])
    per = KBLOCK // bs
    supers = [by_tile(blocks.d)] + ([by_tile(-blocks.dmin)] if blocks.dmin is not None else [])
    return torch.cat([torch.cat(parts, dim=2).view(tiles, nb // per, -1), *supers], dim=2).reshape(-1)



def quantize_activations(x: torch.Tensor, scales: int) -> torch.Tensor:
    """x (..., K) as the kernel sees it for a weight whose scales are in format `scales`
    (`Blocks.scales`), in float32: ggml's rows for that weight's type.
    Q8_0 and Q5_0 (scales 2), Q8_0 rows: per 32 inputs round(x 127 / max|x|), times
    max|x| / 127 rounded to float16. K-quants, Q8_K rows: per 256 inputs, with m the input
    of largest |x| (the first such), min(127, round(x (-127 / m))) times 1 / (-127 / m).
    Ties round to even, as ggml's; an all-zero block is zeros. (Divisions are tensor by
    tensor: torch computes a number over a tensor as a reciprocal times the number, which
    rounds twice.)"""
    shape = x.shape
    if scales == 2:
        blocks = x.float().reshape(*shape[:-1], -1, XBLOCK)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        q = torch.round(blocks * inverse).clamp_(-127, 127)
        return (q * (amax / 127.0).half().float()).reshape(shape)
    blocks = x.float().reshape(*shape[:-1], -1, KBLOCK)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    inverse = torch.where(largest != 0, torch.full_like(largest, -127.0) / largest, torch.zeros_like(largest))
    d = torch.where(largest != 0, torch.ones_like(largest) / inverse, torch.zeros_like(largest))
    return (torch.round(blocks * inverse).clamp_(-127, 127) * d).reshape(shape)


def reference(x: torch.Tensor, weight: torch.Tensor, scales: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: activations quantized for the weight's type
    times the dequantized float32 weight (N, K), in x's dtype."""
    return torch.nn.functional.linear(quantize_activations(x, scales), weight).to(x.dtype)


@dataclass
class Segment:
    """Output channels [first, first + n) of a linear, from one GGUF tensor."""

    kind: str
    first: int
    n: int
    bs: int
    scales: int  # Blocks.scales
    bits: int
    packed: torch.Tensor | None  # the kernel's layout, or None on the reference path
    weight: torch.Tensor | None  # (n, K) float32, the reference path's


def quantize_gguf_linears(model: nn.Module, native_kernels: bool | None = None) -> Counter:
    """Compute every linear of `model` whose weight came whole from quantized GGUF tensors
    (`model.gguf_sources`) from their blocks, in place; the others are left alone. Returns
    the block types used (type -> linears)."""
    sources = getattr(model, "gguf_sources", {})
    by_param = {id(p): sources[name] for name, p in model.named_parameters(remove_duplicate=False) if name in sources}
    used: Counter = Counter()
    native_linears = []
    for linear in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        parts = by_param.get(id(linear.weight))
        if not parts or not all(kind in TYPES for _, kind, _ in parts):
            continue
        if linear.in_features % XBLOCK:
            continue
        native_here = native_kernels if native_kernels is not None else (
            linear.weight.device.type == "cpu" and linear.weight.dtype in _SUFFIX and _library() is not None)
        segments = []
        for rows, kind, raw in parts:
            blocks = unpack(kind, raw)
            if blocks.u.shape != (rows.stop - rows.start, linear.in_features):
                break
            segments.append(Segment(kind, rows.start, rows.stop - rows.start, blocks.bs, blocks.scales,
                                    blocks.bits, pack(blocks) if native_here else None,
                                    None if native_here else blocks.dequantize().to(linear.weight.device)))
        else:
            if sum(s.n for s in segments) != linear.out_features:
                continue
            linear.gguf_segments = sorted(segments, key=lambda s: s.first)
            if native_here:
                native_linears.append(linear)
            linear.bias_f32 = None if linear.bias is None else linear.bias.detach().float()
            linear.forward = types.MethodType(_native_forward if native_here else _reference_forward, linear)
            linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device),
                                         requires_grad=False)
            used.update({s.kind for s in segments})
    # every step streams through all of them, in this order: one mapping of 2 MiB pages
    segments = [s for linear in native_linears for s in linear.gguf_segments]
    for segment, packed in zip(segments, into_huge_pages([s.packed for s in segments])):
        segment.packed = packed
    for linear in native_linears:
        linear.gguf_call = SegmentsCall(linear.gguf_segments, linear.in_features, linear.out_features)
    return used


class SegmentsCall:
    """A native linear's segments as the kernel takes them (gguf_segments_*: one call
    quantizes the rows once for every segment): parallel arrays and the kernel functions,
    bound once (a decode step makes ~70 of these calls)."""

    def __init__(self, segments: list[Segment], in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.weights = (ctypes.c_void_p * len(segments))(*(s.packed.data_ptr() for s in segments))
        self.packed = [s.packed for s in segments]  # what the pointers point into
        self.n_out, self.bs, self.scales, self.bits, self.first = (
            torch.tensor(values, dtype=torch.int64) for values in
            zip(*((s.n, s.bs, s.scales, s.bits, s.first) for s in segments)))
        self.args = (len(segments), self.weights, self.n_out.data_ptr(), self.bs.data_ptr(), self.scales.data_ptr(),
                     self.bits.data_ptr(), self.first.data_ptr())
        self.functions = {dtype: getattr(_library(), f"gguf_segments_{suffix}") for dtype, suffix in _SUFFIX.items()}

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (M, K) CPU bfloat16 or float32, unit last stride -> (M, N) in their dtype."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
        check_status(self.functions[rows.dtype](rows.data_ptr(), rows.stride(0), rows.shape[0], self.in_features,
                                                *self.args, out.data_ptr(), self.out_features,
                                                torch.get_num_threads()), "GGUF linear")
        return out


def _reference_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = torch.cat([reference(x, s.weight, s.scales) for s in self.gguf_segments], dim=-1)
    return out if self.bias_f32 is None else (out.float() + self.bias_f32).to(x.dtype)


def _native_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = self.gguf_call(native_rows(self, x, "GGUF linear"))
    if self.bias_f32 is not None:
        out = (out.float() + self.bias_f32).to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
