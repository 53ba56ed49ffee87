"""The session fixtures of the live tests (registered once, by tests/conftest.py): the
tiny models, and plain colocated servers of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server_harness import ARCHS, ServerProcess, running_server


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pd.models.make_model import make_model

    root = tmp_path_factory.mktemp("server-models")
    return {arch: make_model(arch, root / arch, seed=1) for arch in ARCHS}


class Colocated:
    """`colocated[arch]`: a `pd serve` of that tiny model with no flags, started on first
    use and kept for the worker's session. The tests compare against its answers, or
    send it requests that leave it as they found it: nothing killed, no setting changed,
    KV usage back to 0, and no assertion on a counter another test may have moved."""

    def __init__(self, models: dict[str, Path], logs: Path, stack: contextlib.ExitStack) -> None:
        self.models, self.logs, self.stack = models, logs, stack
        self.servers: dict[str, ServerProcess] = {}

    def __getitem__(self, arch: str) -> ServerProcess:
        if arch not in self.servers:
            self.servers[arch] = self.stack.enter_context(running_server(self.models[arch],
                                                                         self.logs / f"{arch}.log"))
        return self.servers[arch]


@pytest.fixture(scope="session")
def colocated(tiny_models, tmp_path_factory) -> Iterator[Colocated]:
    with contextlib.ExitStack() as stack:
        yield Colocated(tiny_models, tmp_path_factory.mktemp("colocated"), stack)
