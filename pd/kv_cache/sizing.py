"""`--kv-cache-memory auto` (the default): a KV cache sized to the machine.

On a CPU: a quarter of the memory available at start (`MemAvailable`) once the weights are
taken out (their files' size); on a GPU: 90 % of the device's memory (vLLM's
`gpu_memory_utilization`) less what is in use and the weights. Divided among the
tensor-parallel ranks (each holds that much for its heads; all are assumed on this node),
then kept between 256 MiB and 64 GiB. Prefill and decode servers size alike: both live on
their prefix caches (P on prompt prefixes, D on turns it can lend back), and a quarter
each leaves half the host to the rest when a P and a D share it.

`PD_KV_CACHE_MEMORY` (bytes), where set, replaces the automatic size: for hosts running
many small servers at once (the test suite sets it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

CPU_FRACTION = 0.25
GPU_UTILIZATION = 0.9
MIN_BYTES = 256 * 1024 * 1024
MAX_BYTES = 64 * 1024 ** 3
MAX_TOKENS = 4 * 1024 * 1024  # per rank: past this, blocks are bookkeeping no workload reaches
ENV = "PD_KV_CACHE_MEMORY"


def auto_kv_cache_memory(model: Path, device: Callable[[], str], tp: int) -> tuple[int, str]:
    """(bytes per rank, how they were chosen)."""
    pinned = os.environ.get(ENV)
    if pinned:
        try:
            value = int(pinned)
        except ValueError:
            raise ValueError(f"${ENV} must be a number of bytes, got {pinned!r}") from None
        if value <= 0:
            raise ValueError(f"${ENV} must be positive, got {value}")
        return value, f"auto: ${ENV}"
    weights = weight_bytes(model)
    if device().startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info()
        budget = GPU_UTILIZATION * total - (total - free) - weights
        why = (f"{GPU_UTILIZATION:.0%} of the GPU's {_gib(total)} less {_gib(total - free)} in use and "
               f"{_gib(weights)} of weights")
    else:
        available = memory_available()
        budget = CPU_FRACTION * (available - weights)
        why = f"{CPU_FRACTION:.0%} of {_gib(available)} available less {_gib(weights)} of weights"
    if tp > 1:
        budget /= tp
        why += f", over {tp} ranks"
    size = int(min(max(budget, MIN_BYTES), MAX_BYTES))
    return size, f"auto: {why}"


def weight_bytes(model: Path) -> int:
    """The weights' files' size: a .gguf file, or a folder's safetensors."""
    model = Path(model)
    if model.is_file():
        return model.stat().st_size
    return sum(f.stat().st_size for f in model.glob("*.safetensors")) if model.is_dir() else 0


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); the physical memory where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(n: float) -> str:
    return f"{n / 1024 ** 3:.1f} GiB"
