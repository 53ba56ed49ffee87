"""Our GGUF reader held against the gguf package reading the same file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from pd.models.gguf_file import GGUFFile


def assert_same_as_the_reference(path: Path, reference: gguf.GGUFReader | None = None) -> None:
    ours, reference = GGUFFile(path), reference or gguf.GGUFReader(path)
    keys = [key for key in reference.fields if not key.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.fields[key] == reference.fields[key].contents(), key
    assert len(ours.tensors) == len(reference.tensors) > 0
    for got, expected in zip(ours.tensors, reference.tensors):
        assert (got.name, got.tensor_type, got.shape) == (expected.name, expected.tensor_type,
                                                          tuple(int(d) for d in expected.shape))
        assert got.data.dtype == expected.data.dtype and got.data.shape == expected.data.shape, got.name
        assert np.array_equal(got.data, expected.data, equal_nan=True), got.name
