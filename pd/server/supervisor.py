"""What a server does when its engine-core process dies (it was killed, or crashed in
native code): start a new one, at most `--restart-engine` times over the server's life,
or end the server with exit code 1, so that whatever supervises it (systemd, Kubernetes,
Ray, `deploy/`) starts it again. Never a live server answering 503 for good.

Requests in flight when the engine dies fail (503 `engine_dead` for those that had not
reached it, the engine error for the others), as do requests that arrive while a new
engine starts; `/health` answers 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1


async def supervise(client: Any, max_restarts: int, stop_server: Callable[[], None],
                    on_restart: Callable[[], None] = lambda: None) -> None:
    """Watch `client`'s engine until the server stops: restart it when it dies while
    restarts are left (then `on_restart()`), else `stop_server()` (the server then exits
    with code 1) and return."""
    while True:
        while client.is_alive:
            await asyncio.sleep(WATCH_INTERVAL_S)
        if client.restarts >= max_restarts:
            logger.error("the engine died (%s) and %s: stopping the server (exit code 1)", client.dead_error,
                         f"{max_restarts} restarts were allowed (--restart-engine)" if max_restarts
                         else "restarting it is off (--restart-engine 0)")
            stop_server()
            return
        logger.warning("the engine died (%s); starting a new one (restart %d of %d)", client.dead_error,
                       client.restarts + 1, max_restarts)
        try:
            await client.restart()
        except Exception as exc:  # EngineStartupError, or the sockets or folder it needs (OSError, ZMQError)
            logger.error("the new engine did not start (%s: %s): stopping the server (exit code 1)",
                         type(exc).__name__, exc)
            stop_server()
            return
        on_restart()
        logger.warning("a new engine (pid %s) serves", client.pid)
