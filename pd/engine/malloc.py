"""glibc malloc settings for the engine process: keep freed memory instead of returning it.

By default glibc serves large allocations with fresh mmap()s and trims the heap top once
128 KiB of it is free, so a step that allocates and frees multi-MB tensors (a prefill's
activations, a long context's gathered keys) hands the memory back to the kernel and
takes page faults to get it again the next step: at context 1,500 that was 14,000 faults
and ~20 ms of a 30 ms step. Serving from the heap up to 32 MiB (glibc's upper bound for
this setting) and trimming only past 1 GiB free keeps the pages mapped. The memory is
not lost: it is reused by the next step's allocations of the same sizes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


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
