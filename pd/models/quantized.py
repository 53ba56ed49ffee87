"""`--quantization int8`: linear layers (the lm_head included) with int8 weights.

Weights are quantized once, per output channel; each call quantizes its input rows per row,
sums the int8 products exactly and scales the sums back (W8A8, activations quantized at run
time). Both sides are first rotated by a block Hadamard matrix, which spreads a row's few
outlier channels over their block; `pd/csrc/int8_linear.c` says why the activations are
quantized too, and why the rotation. Half the weight bytes of bfloat16 and, on a CPU with
AVX-512 VNNI, twice the multiplies per instruction (on AVX2, vpmaddwd: int8_linear.c).

On CPU the native kernel computes it. Elsewhere (another device, no compiler,
`PD_NATIVE_KERNELS=0`) `reference` does the same arithmetic with torch ops: the rotation
with the same additions in the same order, the int8 sums in float32 (exact while they
stay under 2^24: rows up to 1,040 wide at the extreme, far wider for real activations), so
the two paths agree to float32 rounding of the last step.

Like `pd.models.packed`, a quantized layer keeps its class (a `MergedLinear` still
splits) and loses its floating-point weight: the int8 copy takes its place (a tied
lm_head's storage lives on in the embedding that shares it).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import types

import torch
from torch import nn

from pd import native
from pd.huge_pages import into_huge_pages

logger = logging.getLogger(__name__)

SOURCE = native.SOURCES / "int8_linear.c"
HADAMARD_ROWS = 1024  # rows rotated at a time by `hadamard`
MAX_ROTATION = 128  # inputs per Hadamard block (fewer where the width has no such factor)
TILE, GROUP = 32, 4  # the packed layout: output channels per tile, inputs per group (int8_linear.c)
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_I64, _PTR = native.I64, native.PTR
_LINEAR_ARGS = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, native.F32, _PTR, _I64, _I64]


@functools.cache
def _library() -> ctypes.CDLL | None:
    signatures = {f"int8_linear_{suffix}": _LINEAR_ARGS for suffix in _SUFFIX.values()}
    signatures["pack_int8_weight"] = [_PTR, _I64, _I64, _I64, _PTR]
    return native.load(SOURCE, signatures)


def rotation_block(width: int) -> int:
    """The Hadamard block for rows `width` wide: the largest power of two dividing it, up
    to MAX_ROTATION."""
    return math.gcd(width, MAX_ROTATION)


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x H (float32), H the unnormalized Sylvester-Hadamard matrix of order `block` applied
    to each block of the last dim: butterflies (a, b) -> (a + b, a - b) over pairs h apart,
    h = 1, 2, 4, ..., the additions of `hadamard` in int8_linear.c in its order. In place
    on a float32 copy, HADAMARD_ROWS rows at a time (cache-sized: the lm_head of a 262k
    vocabulary rotates 4x faster than with a new tensor per pass)."""
    shape, width = x.shape, x.shape[-1]
    v = x.reshape(-1, width).to(torch.float32, copy=True)
    for start in range(0, v.shape[0], HADAMARD_ROWS):
        rows = v[start:start + HADAMARD_ROWS]
        h = 1
        while h < block:
            pairs = rows.view(rows.shape[0], width // (2 * h), 2, h)
            a = pairs[:, :, 0].clone()
            pairs[:, :, 0].add_(pairs[:, :, 1])  # a + b
            pairs[:, :, 1].neg_().add_(a)  # -b + a: a - b exactly
            h *= 2
    return v.reshape(shape)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dim (float32 x): (q, scale) with x ~= q * scale,
    scale (..., 1) float32 = max|x| / 127 (1 for an all-zero row)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x * (1.0 / scale)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def reference(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              block: int) -> torch.Tensor:
    """The int8 linear with torch ops on any device: x (..., K) in its dtype, weight_q
    (N, K) int8 and weight_scale (N,) float32 as `quantize_weight` made them."""
    xq, xs = quantize_rows(hadamard(x, block))
    sums = torch.nn.functional.linear(xq.float(), weight_q.float())
    y = sums * (xs * _norm(block)) * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(N, K) weight -> (int8 (N, K), float32 scale (N,), Hadamard block): each row rotated
    by the block Hadamard matrix (normalized: W H / sqrt(block)) and quantized symmetrically."""
    block = rotation_block(weight.shape[1])
    rotated = hadamard(weight, block) * _norm(block)
    q, scale = quantize_rows(rotated)
    return q, scale[:, 0].contiguous(), block


def _norm(block: int) -> torch.Tensor:
    return torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32)


def quantize_linears(model: nn.Module) -> int:
    """Quantize every `nn.Linear` of `model` (the lm_head included) in place; the number
    quantized."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        _quantize(linear)
    native_linears = [m for m in linears if m.weight_q is None]  # every step streams through them, in this order
    for linear, packed in zip(native_linears, into_huge_pages([m.weight_packed for m in native_linears])):
        linear.weight_packed = packed
    if linears and linears[0].weight_q is not None:
        logger.warning("int8 linear layers run on the torch reference path (no native kernel for %s %s): "
                       "slower than unquantized", linears[0].weight.dtype, linears[0].weight.device)
    return len(linears)


def _quantize(linear: nn.Linear) -> None:
    q, linear.weight_scale, linear.rotation_block = quantize_weight(linear.weight.detach())
    linear.rotation_norm = float(_norm(linear.rotation_block))
    linear.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()
    if q.device.type == "cpu" and linear.weight.dtype in _SUFFIX and _library() is not None:
        linear.weight_packed, linear.weight_q = pack(q), None
        linear.forward = types.MethodType(_native_forward, linear)
    else:
        linear.weight_q = q
        linear.forward = types.MethodType(_reference_forward, linear)
    linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype, device=q.device), requires_grad=False)


def pack(weight_q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the kernel's layout: tiles of 32 channels x groups of 4 inputs,
    offset by 128 (uint8)."""
    n, k = weight_q.shape
    weight_q = weight_q.contiguous()
    out = torch.empty(-(-n // TILE) * -(-k // GROUP) * TILE * GROUP, dtype=torch.uint8)
    if _library().pack_int8_weight(weight_q.data_ptr(), n, k, k, out.data_ptr()):
        raise ValueError(f"cannot pack an int8 weight of shape {tuple(weight_q.shape)}")
    return out


def _reference_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return reference(x, self.weight_q, self.weight_scale, self.bias_f32, self.rotation_block)


def native_rows(linear: nn.Linear, x: torch.Tensor, what: str) -> torch.Tensor:
    """x as a native linear kernel takes it: rows (M, K) with a unit last stride;
    ValueError unless CPU bfloat16/float32 rows of K."""
    if x.device.type != "cpu" or x.dtype not in _SUFFIX or x.shape[-1] != linear.in_features:
        raise ValueError(f"{what} takes CPU bfloat16/float32 rows of {linear.in_features}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def check_status(status: int, what: str) -> None:
    """A native linear kernel's status: 0 fine, 2 no memory, else refused arguments."""
    if status:
        raise MemoryError(f"{what}: no memory for the quantized input") if status == 2 else \
            ValueError(f"native {what} refused its arguments")


def _native_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = native_rows(self, x, "int8 linear")
    out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
    status = getattr(_library(), f"int8_linear_{_SUFFIX[x.dtype]}")(
        rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], self.weight_packed.data_ptr(),
        self.out_features, self.weight_scale.data_ptr(), None if self.bias_f32 is None else self.bias_f32.data_ptr(),
        self.rotation_block, self.rotation_norm, out.data_ptr(), out.stride(0), torch.get_num_threads())
    check_status(status, "int8 linear")
    return out.view(*x.shape[:-1], self.out_features)
