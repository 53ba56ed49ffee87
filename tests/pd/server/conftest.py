"""Fixtures shared by the server tests."""

import contextlib
import os

import pytest

from server_harness import running_server, started_together


class Starter:
    """`start(name, *flags)`: a qwen3 `pd serve` with those flags, logged to NAME.log and
    stopped when the test ends; `start.all((name, *flags), ...)`: several, started side
    by side, returned once all are ready."""

    def __init__(self, model, logs, stack: contextlib.ExitStack) -> None:
        self.model, self.logs, self.stack = model, logs, stack

    def __call__(self, name: str, *args: str, wait: bool = True):
        return self.stack.enter_context(running_server(self.model, self.logs / f"{name}.log", *args, wait=wait))

    def all(self, *specs: tuple[str, ...]) -> list:
        servers = [self(name, *args, wait=False) for name, *args in specs]
        started_together(self.stack, *servers)
        return servers


@pytest.fixture
def start(tiny_models, tmp_path):
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        yield Starter(tiny_models["qwen3"], tmp_path, stack)
