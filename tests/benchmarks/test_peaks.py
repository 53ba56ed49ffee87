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
    # 64 int8 multiply-adds an instruction against float32's 16: far more a second at any clock
    int8, f32 = result["int8 dot (vpdpbusd)"], result["float32 FMA (vfmadd)"]
    assert int8["one_thread"] > 2 * f32["one_thread"]
    assert "| int8 dot (vpdpbusd) |" in capsys.readouterr().out


def test_peaks_refuse_nonsense_arguments() -> None:
    with pytest.raises(SystemExit):
        peaks.main(["--threads", "0"])
