"""Fixtures shared by the server tests."""

import contextlib
import os

import pytest

from tests.support.server_harness import Starter


@pytest.fixture
def start(tiny_models, tmp_path):
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        yield Starter(tiny_models["qwen3"], tmp_path, stack)
