"""Memory backed by 2 MiB pages, for what every decode step streams through: the packed
weights of the native linears (`pd.models.gguf_linear`, `pd.models.quantized`).

From 4 KiB pages a streaming read of a step's weights is slower than the machine's memory
allows: a TLB miss every 64 cache lines, and the hardware prefetchers stop at each page's
end. Linux backs an anonymous mapping with transparent huge pages where it is asked to
(`MADV_HUGEPAGE`; the default `enabled` setting, `madvise`, gives them to no one else), so
the weights are copied at load into one such mapping. On the real Gemma 3 270M's lm_head
(178 MB of Q8_0) that took a 1-row call 6.5 -> 4.9 ms and an 8-row one 9.4 -> 6.4 ms
(README, Performance). numpy asks the same for its large arrays, so the machine's read
bandwidth (`benchmarks.peaks`) was already measured from huge pages.

Where the kernel gives none (THP `never`, or another OS), the mapping is ordinary memory
and nothing else changes.

Only memory filled at load: the first touch of a huge page may wait while the kernel
compacts memory to find one (the `madvise` defrag setting), which a serving step must not.
So the KV cache, whose pages are first touched as requests fill it, keeps 4 KiB pages
(with it in huge pages the batch-8 step's attention measured 5.98 -> 5.46 ms, but the
served runs did not gain).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start: a cache line, as the kernels' vector loads prefer


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes`, starting on a 2 MiB boundary of an anonymous
    mapping asked to be backed by huge pages. It holds the mapping: the memory lives as
    long as the tensor or a view of it does."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: they fault in as 2 MiB pages
    except (AttributeError, OSError) as error:  # no such advice on this OS or kernel
        logger.debug("no transparent huge pages for the weights: %s", error)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def into_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, any dtype and shape), in order, end to end (each start
    64-byte aligned) in one `huge_page_buffer`; none for none."""
    if not tensors:
        return []
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // ALIGN) * ALIGN
    buffer = huge_page_buffer(end)
    copies = []
    for tensor, start, size in zip(tensors, starts, sizes):
        copy = buffer[start:start + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
