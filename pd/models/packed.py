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


def pack_linears(model: nn.Module) -> int:
    """Pack every `nn.Linear` of a CPU bfloat16 or float32 model in place; the number packed (0
    where packing does not apply or oneDNN refuses it)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears or not packing_supported(linears[0].weight.dtype, linears[0].weight.device):
        return 0
    try:
        for linear in linears:
            _pack(linear)
    except RuntimeError as exc:  # an op this torch build lacks: stay on F.linear
        logger.warning("oneDNN weight packing failed (%s); linear layers stay unpacked", exc)
        return 0
    return len(linears)


def _pack(linear: nn.Linear) -> None:
    linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
    linear.forward = types.MethodType(_packed_forward, linear)
    linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
