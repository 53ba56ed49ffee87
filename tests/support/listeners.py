"""Loopback listeners for fault tests."""

from __future__ import annotations

import contextlib
import socket
import threading


class ConnectionRecorder:
    """A loopback listener that accepts connections, records them and never answers."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self.accepted = 0
        self.open: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                self.accepted += 1
                self.open.append(conn)

    def close(self) -> None:
        self.server.close()
        for conn in self.open:
            conn.close()
