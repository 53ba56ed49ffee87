"""`python -m benchmarks.peaks`: the CPU's multiply-add peaks a decode step is read against."""

from __future__ import annotations

import ctypes
import functools
import json
import operator

import pytest
import torch

from benchmarks import peaks
from pd import native
from pd.huge_pages import huge_page_buffer
from tests.support.mappings import vm_flags

pytestmark = pytest.mark.skipif(not (native.can_build() and native.cpu_has("avx512_vnni")
                                     and native.cpu_has("avx512_bf16")), reason="needs AVX-512 VNNI and BF16")


def test_peaks_are_measured_per_instruction_and_thread_count(tmp_path, capsys) -> None:
    out = tmp_path / "peaks.json"
    result = peaks.main(["--threads", "2", "--seconds", "0.05", "--memory-mib", "64", "--output", str(out)])
    assert json.loads(out.read_text()) == result and list(result) == [*peaks.KINDS, "memory"]
    assert list(result["memory"]) == ["read", "copy"]
    for figures in [*(result[kind] for kind in peaks.KINDS), *result["memory"].values()]:
        assert figures["threads"] == 2 and figures["one_thread"] > 0 and figures["all_threads"] > 0
    printed = capsys.readouterr().out
    assert "| int8 dot (vpdpbusd) |" in printed and "| streaming read |" in printed


def test_a_read_and_a_copy_cover_every_byte_given() -> None:
    """What the rates count (rounds x bytes) is what the kernels touch: the read folds
    every word of every thread's share (their XOR, which `sink` returns), the copy lands
    every byte; an unknown kind is refused."""
    library = peaks._library()
    words = torch.randint(0, 1 << 52, (1 << 17,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    source = words.view(torch.uint8)
    target = torch.zeros_like(source)
    sink = ctypes.c_double()
    assert library.bandwidth(0, source.data_ptr(), source.data_ptr(), source.numel(), 1, 2, ctypes.byref(sink)) == 0
    assert int(sink.value) == functools.reduce(operator.xor, words.tolist())
    assert library.bandwidth(1, source.data_ptr(), target.data_ptr(), source.numel(), 1, 2, ctypes.byref(sink)) == 0
    assert torch.equal(source, target)
    assert library.bandwidth(2, source.data_ptr(), target.data_ptr(), source.numel(), 1, 2, ctypes.byref(sink)) == 1


@pytest.mark.parametrize("kind", ["read", "copy"])
def test_the_bandwidth_is_read_from_huge_pages_as_the_weights_are(kind, monkeypatch) -> None:
    """The bound a step is read against comes from memory kept as the step's weights are
    (pd.huge_pages): from 4 KiB pages this machine reads ~0.6x as fast."""
    buffers = []

    def recorded(nbytes: int) -> torch.Tensor:
        buffers.append(huge_page_buffer(nbytes))
        return buffers[-1]

    monkeypatch.setattr(peaks, "huge_page_buffer", recorded)
    calls = []
    library = peaks._library()
    monkeypatch.setattr(peaks, "_library", lambda: _Recording(library, calls))
    assert peaks.bandwidth(kind, 1, 0.0, nbytes=1 << 22, repeats=1) > 0
    read_from = {call[1] for call in calls} | {call[2] for call in calls}
    assert read_from == {b.data_ptr() for b in buffers} and len(buffers) == (2 if kind == "copy" else 1)
    assert all("hg" in vm_flags(b.data_ptr()) for b in buffers)


class _Recording:
    """The kernels' library, with each bandwidth call's arguments kept."""

    def __init__(self, library: ctypes.CDLL, calls: list) -> None:
        self.library, self.calls = library, calls

    def bandwidth(self, *args):
        self.calls.append(args)
        return self.library.bandwidth(*args)


def test_each_kind_counts_its_multiply_adds_per_instruction(monkeypatch) -> None:
    """Timed figures are not compared (the suite's load moves them 2x): the same measured
    instruction rate becomes 64, 32 and 16 multiply-adds per instruction."""
    monkeypatch.setattr(peaks, "measure", lambda kind, threads, seconds: 1.5 * threads)
    result = peaks.run(2, 0.01)
    assert [(r["one_thread"], r["all_threads"]) for r in result.values()] == [(96.0, 192.0), (48.0, 96.0),
                                                                              (24.0, 48.0)]


def test_peaks_refuse_nonsense_arguments() -> None:
    with pytest.raises(SystemExit):
        peaks.main(["--threads", "0"])
