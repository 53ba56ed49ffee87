"""Fixtures shared by the server tests."""

import contextlib
import os

import pytest

from conftest_models import tiny_models  # noqa: F401  (the session fixture)
from server_harness import running_server


@pytest.fixture
def start(tiny_models, tmp_path):  # noqa: F811
    """`start(name, *flags)`: a qwen3 `pd serve` with those flags, logged to NAME.log and
    stopped when the test ends."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        yield lambda name, *args: stack.enter_context(
            running_server(tiny_models["qwen3"], tmp_path / f"{name}.log", *args))
