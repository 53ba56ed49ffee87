"""Real `pd serve` processes for the server tests: started on free loopback ports, waited
for, and always stopped (SIGTERM, then SIGKILL) by `running_server`'s `finally`."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ARCHS = ["qwen3", "gemma3", "bamba", "granitehybrid"]
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running `pd serve`: its base URL, process and log file."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its name and labels as written."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def wait_for_metric(self, name: str, predicate, timeout: float = 5.0) -> float:
        """Poll /metrics until `predicate(value)`; the last value either way."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics()[name]
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)


def _wait_ready(server: ServerProcess, name: str, ready: Callable[[int], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"pd {name} exited with {server.process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if ready(server.health().status_code):
                return
        time.sleep(0.1)
    raise RuntimeError(f"pd {name} not ready after {timeout} s:\n{server.log_tail()}")


def stop_process(process: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _running(name: str, log_path: Path, ready: Callable[[int], bool], *args: str,
             port: int | None = None) -> Iterator[ServerProcess]:
    """Start `pd NAME --host 127.0.0.1 --port P *args` on port P (a free one unless
    given); yield it once `ready(status of /health)`; always stop it."""
    port = port or free_port()
    cmd = [str(Path(sys.executable).parent / "pd"), name, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
            _wait_ready(server, name, ready, STARTUP_TIMEOUT_S)
            yield server
        finally:
            stop_process(process)


def running_server(model_dir: Path, log_path: Path, *args: str,
                   port: int | None = None) -> contextlib.AbstractContextManager[ServerProcess]:
    """`pd serve --model model_dir *args`, yielded once healthy (on `port`, or a free
    one). One torch thread each: several servers share this machine's cores, and
    oversubscribed threads spin (the tests check behaviour, not speed)."""
    return _running("serve", log_path, lambda status: status == 200,
                    "--model", str(model_dir), "--num-threads", "1", *args, port=port)


def running_proxy(log_path: Path, *args: str) -> contextlib.AbstractContextManager[ServerProcess]:
    """`pd proxy *args`, yielded once it answers /health (200, or 503 with no healthy server)."""
    return _running("proxy", log_path, lambda status: status in (200, 503), *args)
