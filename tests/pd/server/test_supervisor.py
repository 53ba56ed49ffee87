"""The supervisor (pd/server/supervisor.py) on its own: whatever stops a new engine from
starting ends the server (exit 1), never a server left answering 503 for good."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from pd.engine.client import EngineStartupError
from pd.server import supervisor


class DeadEngine:
    is_alive = False
    dead_error = "killed"

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.restarts = 0

    async def restart(self) -> None:
        raise self.error


@pytest.mark.parametrize("error", [EngineStartupError("no memory"), OSError(28, "No space left on device"),
                                   zmq.ZMQError(98)])
def test_a_new_engine_that_cannot_start_for_any_reason_stops_the_server(error) -> None:
    stopped = []

    async def main() -> None:
        await asyncio.wait_for(supervisor.supervise(DeadEngine(error), 3, lambda: stopped.append(True)), 10)

    asyncio.run(main())
    assert stopped == [True]
