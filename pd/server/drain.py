"""`pd serve`'s drain on SIGTERM: the server stops taking requests, hands its streams on
to other servers with their KV, lets the rest finish and the blocks it keeps be read,
then exits.

The first SIGTERM (once the server has started, with `--drain-timeout` > 0) sets the app's
server draining: a new request is answered 503 `server_draining` before anything of it is
done (the proxy sends it to another server), and a registered server tells its proxy at
once (`registration.py`: it stays in the fleet, draining, while it renews). Each stream
the proxy can take elsewhere (`X-PD-Migratable`) is paused at a step boundary and ends
with a `migrated` error event naming its KV, which the server keeps under a lease for the
decode server the proxy resumes it on (pd/server/resume.py, proxy/migration.py); an
unstreamed answer, or a client's own stream, finishes here. The server
exits when nothing is in flight and its connector keeps no blocks for a reader (D read
them, the proxy released them, or their lease ended), or when the drain's time is over.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import uvicorn

from pd.server.registration import Registrar

logger = logging.getLogger("pd.serve")

DRAIN_POLL_S = 0.1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains the app's server before it exits:
    new requests are refused (503 server_draining), the proxy is told (a registered
    server), and the server exits once nothing is in flight and no blocks are kept for a
    reader, or `drain_timeout_s` has passed. SIGINT, a second SIGTERM, or a SIGTERM before
    the server started exit at once, as uvicorn does."""

    def __init__(self, config: Any, app_server: Any, registrar: Registrar | None, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.app_server, self.registrar, self.drain_timeout_s = app_server, registrar, drain_timeout_s
        self.loop = asyncio.get_running_loop()
        self.drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig != signal.SIGTERM or self.drain_timeout_s <= 0 or self.app_server.draining or not self.started:
            super().handle_exit(sig, frame)
            return
        self.app_server.draining = True
        self._captured_signals.append(sig)  # raised again once uvicorn is done: the process exits as on SIGTERM
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.drain = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        logger.info("SIGTERM: draining for at most %.0f s (no new request; the proxy's streams are handed on "
                    "with their KV, the rest finish, kept blocks wait for their reader)", self.drain_timeout_s)
        if self.registrar is not None:
            await self.registrar.send_now("draining")
        deadline = time.monotonic() + self.drain_timeout_s
        while not self.app_server.drained and time.monotonic() < deadline:
            await self.app_server.hand_on()
            await asyncio.sleep(DRAIN_POLL_S)
        if self.app_server.drained:
            logger.info("drained: exiting")
        else:
            logger.warning("the drain's %.0f s are over with %d requests in flight: exiting", self.drain_timeout_s,
                           len(self.app_server.in_flight))
        self.should_exit = True
