"""Linear layers with their weights reordered once, at start-up, for oneDNN on CPU.

A bfloat16 `F.linear` on CPU reorders its weight into oneDNN's blocked layout on every
call; for the few-row matmuls of a decode step that reorder is as costly as the matmul
(Gemma 3 270M's lm_head: 15 ms for 8 rows, 10 ms from a weight packed once). The packed
forward computes the same products in the same order: outputs are bitwise those of
`F.linear`. A float32 `F.linear` goes to the BLAS torch was built with, which on this
project's AMD CPUs runs 1.5-2.5x slower than oneDNN's packed kernels (8 x 256 @ 256 x
4096: 176 -> 62 us; 2048 rows: 5.4 -> 2.2 ms); those sum in another order, so float32
outputs agree to float32 rounding. A packed layer drops its own weight parameter: the
packed copy takes its memory's place (a tied lm_head's storage lives on in the embedding
that shares it).

On a CPU whose oneDNN cannot pack bfloat16 (AVX2 only: no AVX-512, no AVX-NE-CONVERT),
torch's bfloat16 matmul is emulated and slow (256 x 640 @ 640 x 2048: 38.6 ms against
5.3 ms in float32 on such a machine; even one row is slower). There a bfloat16 linear is
*widened*: its weight is packed as float32 (exact: every bfloat16 is a float32), its input
converted to float32, its output rounded back to bfloat16 — the products and the float32
sums a native bfloat16 matmul makes, in another order, for twice the weight memory.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float32)
BATCH_HINT = 8  # rows oneDNN tunes the layout for; any row count works


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN packs `dtype` weights on this device (bfloat16 needs AVX-512 or
    AVX-NE-CONVERT; on an AVX2-only CPU it is refused)."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available() \
        and _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


def widens(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `dtype` linears on `device` are packed as float32 (bfloat16 where oneDNN
    packs float32 but not bfloat16)."""
    return dtype == torch.bfloat16 and not packing_supported(dtype, device) \
        and packing_supported(torch.float32, device)


def pack_linears(model: nn.Module) -> int:
    """Pack every `nn.Linear` of a CPU bfloat16 or float32 model in place (bfloat16 ones
    widened to float32 where only that packs); the number packed (0 where packing does
    not apply or oneDNN refuses it)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and not hasattr(m, "gguf_segments")]
    if not linears:
        return 0
    dtype, device = linears[0].weight.dtype, linears[0].weight.device
    widen = widens(dtype, device)
    if not widen and not packing_supported(dtype, device):
        return 0
    try:
        for linear in linears:
            _pack(linear, widen)
    except RuntimeError as exc:  # an op this torch build lacks: stay on F.linear
        logger.warning("oneDNN weight packing failed (%s); linear layers stay unpacked", exc)
        return 0
    if widen:
        logger.info("bfloat16 linears run in float32 (this CPU's oneDNN has no bfloat16 kernels; torch's own are "
                    "several times slower): their weights take twice the memory")
    return len(linears)


def _pack(linear: nn.Linear, widen: bool) -> None:
    weight = linear.weight.detach()
    linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.float() if widen else weight, BATCH_HINT)
    if widen:
        linear.packed_bias = None if linear.bias is None else linear.bias.detach().float()
        linear.forward = types.MethodType(_widened_forward, linear)
    else:
        linear.forward = types.MethodType(_packed_forward, linear)
    linear.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _widened_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed_weight, self.packed_bias, "none", [], "")
    return out.to(x.dtype)
