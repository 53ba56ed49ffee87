"""`python -m benchmarks.peaks`: the CPU's multiply-add peaks a decode step is read against."""

from __future__ import annotations

import json

import pytest

from benchmarks import peaks
from pd import native

pytestmark = pytest.mark.skipif(not (native.can_build() and native.cpu_has("avx512_vnni")
                                     and native.cpu_has("avx512_bf16")), reason="needs AVX-512 VNNI and BF16")


def test_peaks_are_measured_per_instruction_and_thread_count(tmp_path, capsys) -> None:
    out = tmp_path / "peaks.json"
    result = peaks.main(["--threads", "2", "--seconds", "0.05", "--output", str(out)])
    assert json.loads(out.read_text()) == result and list(result) == list(peaks.KINDS)
    for figures in result.values():
        assert figures["threads"] == 2 and figures["one_thread"] > 0 and figures["all_threads"] > 0
    assert "| int8 dot (vpdpbusd) |" in capsys.readouterr().out


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
