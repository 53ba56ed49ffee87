"""The weights' fingerprint: the same for the same bytes wherever they lie, another for
other weights, another quantization of a GGUF, or a tensor of a MiB changed in place; and
it reads a sixteenth of a file."""

from __future__ import annotations

import os
import shutil

from pd.models import fingerprint
from pd.models.fingerprint import STRIDE, WINDOW, weights_fingerprint
from pd.models.make_model import make_model


def test_the_same_weights_anywhere_have_one_fingerprint_and_other_weights_another(tmp_path) -> None:
    a = make_model("qwen3", tmp_path / "a", seed=0)
    copy = shutil.copytree(a, tmp_path / "copy")
    other = make_model("qwen3", tmp_path / "other", seed=1)
    assert weights_fingerprint(a) == weights_fingerprint(copy)
    assert weights_fingerprint(a) != weights_fingerprint(other)


def test_a_tensor_changed_in_place_changes_it(tmp_path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    data = bytearray(os.urandom(5 * STRIDE + 12345))
    weights.write_bytes(data)
    before = weights_fingerprint(model)
    data[3 * STRIDE - 1000: 3 * STRIDE + STRIDE] = os.urandom(STRIDE + 1000)  # a MiB "tensor" rewritten
    weights.write_bytes(data)
    assert weights_fingerprint(model) != before


def test_it_reads_a_window_in_every_mib_and_the_last(monkeypatch, tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(40 * STRIDE))
    reads = []
    real = os.pread
    monkeypatch.setattr(fingerprint.os, "pread", lambda fd, n, off: reads.append((n, off)) or real(fd, n, off))
    weights_fingerprint(gguf)
    size = gguf.stat().st_size
    assert [off for _, off in reads] == [*range(0, size, STRIDE), size - WINDOW]
    assert sum(n for n, _ in reads) <= size // 16 + 2 * WINDOW
