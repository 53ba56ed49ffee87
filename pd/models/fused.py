"""Fused elementwise ops of the decoder layers (`pd/csrc/fused.c`), built by `pd.native`.

Each function here replaces a chain of torch ops in `pd.models.layers` with one native
pass, on CPU tensors of bfloat16 or float32 whose last dim is contiguous; `supports`
says whether a tensor qualifies. The callers keep the torch chain as their other path
(another device or dtype, no compiler, `PD_NATIVE_KERNELS=0`), and the two agree to the
last float32 bit or, in bfloat16, to one unit in rare elements (tested).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pd import native

SOURCE = native.SOURCES / "fused.c"
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
_I64, _PTR, _F32 = native.I64, native.PTR, native.F32
_SIGNATURES = {
    "rms_norm": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _I64],
    "qk_norm_rope": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR,
                     _I64],
    "act_mul": [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64],
    "first_max": [_PTR, _I64, _I64, _I64, _PTR, _I64],
}
MAX_HEAD_SIZE = 1024


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.load(SOURCE, {f"{name}_{suffix}": argtypes for name, argtypes in _SIGNATURES.items()
                                for suffix in _SUFFIX.values()})


def build() -> bool:
    """Build the kernels now (or find them built); whether they are available."""
    return _library() is not None


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops take `x`: on CPU, bfloat16 or float32, rows of contiguous
    elements, no autograd, and the kernels built."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() >= 1 and x.stride(-1) == 1
            and not (x.requires_grad and torch.is_grad_enabled()) and _library() is not None)


@functools.cache
def _kernel(name: str, dtype: torch.dtype):
    return getattr(_library(), f"{name}_{_SUFFIX[dtype]}")


def _call(name: str, dtype: torch.dtype, *args) -> None:
    if _kernel(name, dtype)(*args, torch.get_num_threads()):
        raise ValueError(f"native {name} refused its arguments")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, cols) without copying where its rows are evenly spaced."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) * weight (float32 weight), rounded to x's dtype, plus `residual` (same
    shape and dtype) when given."""
    rows = _rows(x)
    res = None if residual is None else _rows(residual)
    assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.numel() == x.shape[-1]
    assert res is None or (res.dtype == x.dtype and res.shape == rows.shape and res.stride(-1) == 1)
    return rms_norm_rows(rows, weight, eps, res).view(x.shape)


def rms_norm_rows(rows: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """`rms_norm` of rows (M, N) unchecked: for a caller that holds what it asserts
    (`pd.models.native_layers`: a decode step calls this ~70 times)."""
    out = torch.empty(rows.shape, dtype=rows.dtype)
    _call("rms_norm", rows.dtype, rows.data_ptr(), rows.stride(0), None if residual is None else residual.data_ptr(),
          0 if residual is None else residual.stride(0), out.data_ptr(), rows.shape[1], weight.data_ptr(),
          rows.shape[0], rows.shape[1], eps)
    return out


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 positions: torch.Tensor, cos: torch.Tensor,
                 signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the fused projection's output (tokens, (H + 2 KVH) * D), q (tokens, H * D) and
    k (tokens, KVH * D): each head RMS-normed with its float32 weight (None: not normed),
    then rotated by the float32 (positions, rotary_dim) tables (`RotaryEmbedding`'s)."""
    assert qkv.dim() == 2 and qkv.shape[1] >= (num_heads + num_kv_heads) * head_size and head_size <= MAX_HEAD_SIZE
    assert cos.dtype == signed_sin.dtype == torch.float32 and cos.is_contiguous() and signed_sin.is_contiguous()
    for w in (q_weight, k_weight):
        assert w is None or (w.dtype == torch.float32 and w.is_contiguous() and w.numel() == head_size)
    positions = positions.to(torch.int64).contiguous()  # the kernel refuses one outside the tables
    assert positions.numel() == qkv.shape[0]
    return qk_norm_rope_rows(qkv, num_heads, num_kv_heads, head_size, q_weight, k_weight, eps, positions, cos,
                             signed_sin)


def qk_norm_rope_rows(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int,
                      q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                      positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope` unchecked (positions int64 and contiguous; the kernel still refuses
    one outside the tables)."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads * head_size, dtype=qkv.dtype)
    k = torch.empty(tokens, num_kv_heads * head_size, dtype=qkv.dtype)
    _call("qk_norm_rope", qkv.dtype, qkv.data_ptr(), qkv.stride(0), tokens, num_heads, num_kv_heads, head_size,
          None if q_weight is None else q_weight.data_ptr(), None if k_weight is None else k_weight.data_ptr(),
          eps, positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), cos.shape[-1], cos.shape[0], q.data_ptr(),
          k.data_ptr())
    return q, k


def act_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x[..., :I]) * x[..., I:] for x (..., 2 I): the gated MLP's middle."""
    rows = _rows(x)
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _call("act_mul", x.dtype, rows.data_ptr(), rows.stride(0), out.data_ptr(), inter, rows.shape[0], inter,
          ACTIVATIONS[act])
    return out


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first largest value (int64), as `logits.max(dim=-1).indices`
    (a NaN counts as the largest) for logits (rows, vocab) that `supports` takes."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    _call("first_max", logits.dtype, logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr())
    return out
