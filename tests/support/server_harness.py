"""Real `pd serve` processes for the server tests: started on free loopback ports by the
project's one launcher (launch/), waited for, and always stopped (SIGTERM, then SIGKILL,
then whatever is left of the process group) by `running_server`'s `finally`."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from launch import Launched, free_port, http_client, pd_command, running, stop_process, terminate_all, wait_started  # noqa: F401

ARCHS = ["qwen3", "gemma3", "bamba", "granitehybrid"]
# A bound on waiting for a server to reach a state, generous: the suite runs on two
# workers of a 2-core machine, and a state that holds is seen at once anyway.
METRIC_WAIT_S = 30.0
TEST_DRAIN_S = 2.0


def metrics_of(url: str) -> dict[str, float]:
    """Every sample of the /metrics of the server at `url`, keyed by its name and labels
    as written."""
    text = http_client().get(f"{url}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


class ServerProcess(Launched):
    """A running `pd serve` or `pd proxy`: its base URL, process and log file."""

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its name and labels as written."""
        return metrics_of(self.url)

    @property
    def engine_pid(self) -> int:
        """The PID of the server's engine process, as its /health says."""
        health = self.health()
        assert health.status_code == 200, health.text
        return health.json()["engine_pid"]

    def wait_for_metric(self, name: str, predicate, timeout: float = METRIC_WAIT_S) -> float:
        """Poll /metrics until `predicate(value)`; the last value either way."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics()[name]
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)


@contextlib.contextmanager
def _running(name: str, log_path: Path, ready: Callable[[int | None], bool], *args: str,
             port: int | None = None, wait: bool = True, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`pd NAME --host 127.0.0.1 --port P *args` on port P, or without `port` on a port the
    server binds as the kernel picks it (`--port 0`, written to a `--port-file` beside its
    log: nothing can take it between a pick and the bind), yielded once `ready(status of
    /health)` (`wait=False`: at once, to start several side by side and then
    `wait_started(*servers)`: their URLs are known then), with `env` added to this
    process's environment; always stopped."""
    port_file = None if port else log_path.with_suffix(".port")
    cmd = pd_command(name, "--host", "127.0.0.1", "--port", str(port or 0), *args,
                     *(("--port-file", str(port_file)) if port_file else ()))
    with running(cmd, f"http://127.0.0.1:{port or '{port}'}", log_path, ready=ready, wait=wait,
                 env=None if env is None else os.environ | env, port_file=port_file,
                 launched_type=ServerProcess) as launched:
        yield launched


def running_server(model_dir: Path, log_path: Path, *args: str, port: int | None = None, wait: bool = True,
                   env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[ServerProcess]:
    """`pd serve --model model_dir *args`, yielded once healthy (on `port`, or a free
    one). One torch thread each: several servers share this machine's cores, and
    oversubscribed threads spin (the tests check behaviour, not speed). Stopped, it drains
    for at most TEST_DRAIN_S (a fault test may leave blocks held for a lease that is
    longer; a test of the drain gives its own --drain-timeout)."""
    return _running("serve", log_path, lambda status: status == 200, "--model", str(model_dir), "--num-threads",
                    "1", "--drain-timeout", str(TEST_DRAIN_S), *args, port=port, wait=wait, env=env)


def running_proxy(log_path: Path, *args: str,
                  port: int | None = None) -> contextlib.AbstractContextManager[ServerProcess]:
    """`pd proxy *args` (on `port`, or a free one), yielded once it answers /health (200,
    or 503 with no healthy server)."""
    return _running("proxy", log_path, lambda status: status in (200, 503), *args, port=port)


def wait_until(predicate: Callable[[], bool], timeout: float = METRIC_WAIT_S) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; whether it held (a bound on
    waiting, not a measurement). Every 50 ms: many predicates are HTTP requests (some a
    whole completion through the proxy), and at 100 a second they took CPU from the
    other workers while this one waited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def started_together(stack: contextlib.ExitStack, *servers: ServerProcess) -> None:
    """Wait for servers started with `wait=False`; when `stack` closes, they are all sent
    SIGTERM at once (then each is waited for and reaped as usual)."""
    stack.callback(terminate_all, [server.process for server in servers])
    wait_started(*servers)


class Starter:
    """`start(name, *flags)`: a `pd serve` of `model` with those flags, logged to NAME.log
    and stopped when `stack` closes; `start.all((name, *flags), ...)`: several, started
    side by side, returned once all are ready."""

    def __init__(self, model, logs, stack: contextlib.ExitStack) -> None:
        self.model, self.logs, self.stack = model, logs, stack

    def __call__(self, name: str, *args: str, wait: bool = True):
        return self.stack.enter_context(running_server(self.model, self.logs / f"{name}.log", *args, wait=wait))

    def all(self, *specs: tuple[str, ...]) -> list:
        servers = [self(name, *args, wait=False) for name, *args in specs]
        started_together(self.stack, *servers)
        return servers
