"""The tiny-model fixture, shared by the server tests and the proxy tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd.models.make_model import make_model
from server_harness import ARCHS


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-models")
    return {arch: make_model(arch, root / arch, seed=1) for arch in ARCHS}
