"""pd.huge_pages: memory advised for 2 MiB pages, for the packed weights a step streams through."""

from __future__ import annotations

import sys

import pytest
import torch

from pd.huge_pages import ALIGN, HUGE_PAGE, huge_page_buffer, into_huge_pages
from tests.support.mappings import vm_flags

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) and /proc are Linux's")


def test_a_buffer_is_zero_on_a_huge_page_boundary_of_an_advised_mapping() -> None:
    buffer = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE + 5
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert int(buffer.count_nonzero()) == 0
    assert "hg" in vm_flags(buffer.data_ptr()) and "hg" in vm_flags(buffer.data_ptr() + buffer.numel() - 1)


def test_copies_keep_values_dtype_and_shape_end_to_end_and_aligned() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=generator),
               torch.randn(3, 7, generator=generator), torch.randn(5, generator=generator).half(),
               torch.empty(0, dtype=torch.uint8), torch.arange(9, dtype=torch.int64).view(3, 3)]
    copies = into_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and torch.equal(copy, tensor)
        assert copy.data_ptr() != tensor.data_ptr() or tensor.numel() == 0
    starts = [c.data_ptr() for c in copies if c.numel()]  # an empty tensor's is 0
    assert all(start % ALIGN == 0 for start in starts)
    assert starts == sorted(starts) and starts[-1] - starts[0] < 2 * HUGE_PAGE  # one buffer, in order
    assert all("hg" in vm_flags(start) for start in starts)
    del tensors
    assert torch.equal(copies[4], torch.arange(9).view(3, 3))  # the copies hold their own memory
