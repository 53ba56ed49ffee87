"""Memory settings of an engine process (rank 0 and every other tensor-parallel rank):
keep freed memory mapped, and bound the caches of compiled kernels.

**Freed memory.** By default glibc serves large allocations with fresh mmap()s and trims
the heap top once 128 KiB of it is free, so a step that allocates and frees multi-MB
tensors (a prefill's activations, a long context's gathered keys) hands the memory back
to the kernel and takes page faults to get it again the next step: at context 1,500 that
was 14,000 faults and ~20 ms of a 30 ms step. Serving from the heap up to 32 MiB (glibc's
upper bound for this setting) and trimming only past 1 GiB free keeps the pages mapped.
The memory is not lost: it is reused by the next step's allocations of the same sizes.

**Kernel caches.** oneDNN (the packed linears' `mkldnn._linear_pointwise`) keeps a
compiled primitive per input shape, and ideep, torch's layer over it, a computation per
shape beside it: 1,024 of each by default, ~0.4 MB an entry here. A prefill chunk's
token count is a new shape for every linear, so under prompts of every length an
engine's memory grew by ~900 MB before both caches were full (a 1P1D soak: the prefill
server's engine 293 -> 1,104 MB in 200 s and still growing). Both are capped at
`KERNEL_CACHE_ENTRIES` unless the operator set them (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
`LRU_CACHE_CAPACITY`): decode steps' shapes (one per batch size) stay cached, and
rebuilding a prefill chunk's primitives cost nothing measurable (README, "Memory"). They
are read when the first primitive is built, so this runs before any step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
KERNEL_CACHE_ENTRIES = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def apply_memory_settings() -> None:
    """Both settings, for this process (an engine's, or a rank's)."""
    keep_freed_memory()
    bound_kernel_caches()


def bound_kernel_caches() -> None:
    """Cap oneDNN's and ideep's caches of compiled kernels at `KERNEL_CACHE_ENTRIES`
    each, where the environment does not set them; before any kernel is built."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(KERNEL_CACHE_ENTRIES))


def keep_freed_memory() -> bool:
    """Apply the settings to this process; False where the C library is not glibc (the
    allocator there has its own policy, and nothing is changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        logger.warning("mallopt refused the engine's malloc settings; steps may page-fault")
    return done
