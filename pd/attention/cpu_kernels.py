"""Native CPU kernels: C sources in `csrc/`, compiled on first use with the system C
compiler and loaded with ctypes (no torch headers, so a build takes about a second).

The shared object is cached under `$PD_KERNEL_CACHE` (default `~/.cache/pd-kernels`),
keyed by the source, the flags, the compiler and this CPU (it is built for the CPU it
runs on). Without a compiler, or with `PD_NATIVE_KERNELS=0`, nothing is built and the
callers keep their torch paths: the kernels make things faster, never possible.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast")
_SYMBOLS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
             _I64, ctypes.c_float, _PTR, _I64, _I64]


def enabled() -> bool:
    return os.environ.get("PD_NATIVE_KERNELS", "1") != "0"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not enabled() or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler: decode attention stays on its torch path")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_identity()]).encode()).hexdigest()
        cache = Path(os.environ.get("PD_KERNEL_CACHE", Path.home() / ".cache" / "pd-kernels"))
        built = cache / f"{SOURCE.stem}-{key[:16]}.so"
        if not built.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, renamed in: racing builds are safe
                out = Path(tmp) / built.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(out, built)
        library = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the native decode kernel failed (%s); using the torch path", detail)
        return None
    for symbol in _SYMBOLS.values():
        getattr(library, symbol).argtypes = _ARGTYPES
        getattr(library, symbol).restype = ctypes.c_int
    return library


def supports(cache: torch.Tensor) -> bool:
    """Whether `paged_decode` can read this layer's cache view: on CPU, bfloat16 or
    float32, head dim contiguous, and the kernel built."""
    return cache.device.type == "cpu" and cache.dtype in _SYMBOLS and cache.stride(-1) == 1 and _library() is not None


def scratch_size(group: int, head_size: int, max_span: int) -> int:
    """float32 elements of scratch: one share per thread the kernel runs on (torch's
    intra-op thread count, passed to it)."""
    return (group * max_span + 4 * head_size) * torch.get_num_threads()


def paged_decode(query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor, window: int | None, scale: float, out: torch.Tensor,
                 scratch: torch.Tensor, max_span: int) -> torch.Tensor:
    """Attention of one query token per request over its visible cached keys.

    query, out (n, H, D) float32 contiguous; cache one layer's (blocks, 2, block_size,
    KVH, D) view; table int32 (requests, columns) contiguous, `rows[r]` decode r's row;
    positions int64 (n,): each query's position (it sees `[pos - window + 1, pos]`, or
    `[0, pos]` without a window); max_span >= the longest visible span; scratch float32
    of `scratch_size(...)` elements."""
    n, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = cache.shape
    threads = torch.get_num_threads()
    assert scratch.numel() >= scratch_size(num_heads // num_kv_heads, head_size, max_span)
    assert query.is_contiguous() and out.is_contiguous() and table.is_contiguous() and table.dtype == torch.int32
    status = getattr(_library(), _SYMBOLS[cache.dtype])(
        query.data_ptr(), out.data_ptr(), cache.data_ptr(), *cache.stride()[:4], table.data_ptr(), table.stride(0),
        rows.data_ptr(), positions.data_ptr(), n, num_heads, num_kv_heads, head_size, block_size, window or 0,
        scale, scratch.data_ptr(), max_span, threads)
    if status:
        raise ValueError(f"paged_decode refused its arguments ({num_heads} heads over {num_kv_heads}, "
                         f"head size {head_size})")
    return out
