"""Start, health-wait and stop server processes, by the PIDs this process holds.

- `start_logged` runs a command in its own session (a terminal's Ctrl-C reaches only the
  launcher, which then stops what it started), its output in a log file; optionally with
  a parent-death signal, so a killed launcher orphans nothing (Linux).
- `wait_ready` polls the process's `/health` until it answers as wanted, failing with
  the log's tail if the process exits first or the time runs out.
- `stop_process` sends SIGTERM, SIGKILL after a timeout, then ends whatever is left of
  the process group (e.g. the engine process of a server stopped while starting), and
  only then reaps the process, so its PID and group id cannot be reused meanwhile.
- `running` is all three as a context manager; `start` the first two.
- `http_client` is the one HTTP client of this process for talking to what it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from launch.ports import read_port
from wire.fleet import SECRET_ENV

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
GROUP_GRACE_S = 5.0
LOG_TAIL_CHARS = 4000
PR_SET_PDEATHSIG = 1
POLL_S = 0.1


class LaunchError(RuntimeError):
    """A process exited before it was ready, or was not ready in time (the log's tail says why)."""


@dataclass
class Launched:
    """A started process: its base URL, the process and its log file. Started with a
    `port_file`, its URL holds `{port}` until the process wrote the port it listens on
    there (`--port 0 --port-file`: no port is picked before the server binds it)."""

    url: str
    process: subprocess.Popen
    log_path: Path
    # what `wait_started` waits for: the /health predicate, the monotonic deadline, a name for errors
    readiness: tuple[Callable[[int | None], bool], float, str] | None = field(default=None, repr=False)
    port_file: Path | None = field(default=None, repr=False)

    def resolved(self) -> bool:
        """Whether its URL is known (the port written, where it is to be)."""
        if self.port_file is not None and "{port}" in self.url:
            port = read_port(self.port_file)
            if port is None:
                return False
            self.url = self.url.format(port=port)
        return True

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return log_tail(self.log_path, chars)

    def health(self) -> httpx.Response:
        return http_client().get(f"{self.url}/health", timeout=5)


@functools.cache
def http_client() -> httpx.Client:
    """One client per process (httpx's is thread-safe) for the servers it launched. A
    call of `httpx.get` makes a client, and a client loads the CA bundle into an SSL
    context, even for plain http://: 17 ms of CPU per call, which a health poll every
    0.1 s paid over and over."""
    return httpx.Client(timeout=5)


def pd_command(*args: str) -> list[str]:
    """`pd ARGS` run by this Python (no reliance on the `pd` script being on PATH)."""
    return [sys.executable, "-m", "cli.main", *args]


def deployment_secret() -> str:
    """The secret the prefill and decode servers this process starts share (they inherit
    the environment): PD_KV_TRANSFER_SECRET if set, else a new random one, set now."""
    if not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = secrets.token_hex(32)
    return os.environ[SECRET_ENV]


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(no log at {path}: {e})"


def start_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
                 die_with_parent: bool = False) -> subprocess.Popen:
    """Start `cmd` in its own session, output to `log_path`. `die_with_parent`: the child
    gets SIGTERM when the thread that started it dies (start it from a long-lived thread)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preexec = _parent_death_sigterm() if die_with_parent else None
    with open(log_path, "w") as log:
        # preexec only calls prctl(2), resolved beforehand: no locks taken in the child.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=preexec)  # noqa: PLW1509


def _parent_death_sigterm() -> Callable[[], None]:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def health_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The status of `url`/health; None when it does not answer."""
    with contextlib.suppress(httpx.HTTPError):
        return http_client().get(f"{url}/health", timeout=timeout_s).status_code
    return None


def wait_ready(launched: Launched, ready: Callable[[int | None], bool] = lambda status: status == 200,
               timeout_s: float = STARTUP_TIMEOUT_S, name: str = "the process") -> None:
    """Poll `/health` until `ready(status)`; LaunchError if the process exits first or
    `timeout_s` passes (the process is left running: the caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while not (launched.resolved() and ready(health_status(launched.url))):
        if exited(launched.process):
            raise LaunchError(f"{name} exited with {stop_process(launched.process)}; "
                              f"log {launched.log_path}:\n{launched.log_tail()}")
        if time.monotonic() > deadline:
            raise LaunchError(f"{name} not ready after {timeout_s:g} s; log {launched.log_path}:\n"
                              f"{launched.log_tail()}")
        time.sleep(POLL_S)


def start(cmd: list[str], url: str, log_path: Path, ready: Callable[[int | None], bool] = lambda s: s == 200,
          timeout_s: float = STARTUP_TIMEOUT_S, env: dict[str, str] | None = None,
          die_with_parent: bool = False, wait: bool = True, port_file: Path | None = None,
          launched_type: type[Launched] = Launched) -> Launched:
    """Start `cmd` (serving at `url`, where `{port}` is what it writes to `port_file`) and
    return it once ready (`wait=False`: at once; then call `wait_started` on it, e.g.
    after starting others alongside), as a `launched_type`. A process that fails to
    become ready is stopped before LaunchError is raised."""
    name = f"pd {cmd[3]}" if cmd[1:3] == ["-m", "cli.main"] and len(cmd) > 3 else cmd[0]
    if port_file is not None:
        Path(port_file).unlink(missing_ok=True)  # a last run's
    launched = launched_type(url, start_logged(cmd, log_path, env, die_with_parent), log_path, port_file=port_file)
    launched.readiness = (ready, time.monotonic() + timeout_s, name)
    if wait:
        wait_started(launched)
    return launched


def wait_started(*processes: Launched) -> None:
    """Wait until each process `start`ed is ready (they start meanwhile, side by side); a
    process that fails is stopped before LaunchError is raised."""
    for launched in processes:
        ready, deadline, name = launched.readiness
        try:
            wait_ready(launched, ready, max(0.0, deadline - time.monotonic()), name)
        except BaseException:
            stop_process(launched.process)
            raise


@contextlib.contextmanager
def running(cmd: list[str], url: str, log_path: Path, **kwargs) -> Iterator[Launched]:
    """`start(cmd, url, log_path, **kwargs)`, stopped (`stop_process`) however the block ends."""
    launched = start(cmd, url, log_path, **kwargs)
    try:
        yield launched
    finally:
        stop_process(launched.process)


def exited(process: subprocess.Popen) -> bool:
    """Whether `process` has exited. It is left unreaped (a zombie), so its PID, and the
    id of the process group it leads, cannot be reused while we clean up after it."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere: its group id is no longer ours to signal
        process.returncode = -1
        return True


def _wait_exited(process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not exited(process):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, _, group = entry.joinpath("stat").read_text().rpartition(") ")[2].split()[:3]
                if state != "Z" and int(group) == pgid:
                    members.append(int(entry.name))
    return members


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def end_group(pgid: int, grace_s: float = GROUP_GRACE_S) -> None:
    """SIGTERM what is left of the group, then SIGKILL it after `grace_s`."""
    if not _group_members(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _signal_group(pgid, signal.SIGKILL)


def terminate_all(processes: list[subprocess.Popen]) -> None:
    """SIGTERM every process now, so that they shut down side by side; `stop_process`
    then only waits for each (it sends no second SIGTERM, which would cut a graceful
    shutdown short)."""
    for process in processes:
        if not exited(process):
            os.kill(process.pid, signal.SIGTERM)
            _terminated.add(process.pid)


_terminated: set[int] = set()  # PIDs `terminate_all` sent SIGTERM to (still unreaped)


def stop_process(process: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM `process` (started in its own session), SIGKILL it after `timeout_s`, end
    the rest of its process group, then reap it; its exit code."""
    if process.returncode is not None:
        return process.returncode
    if not exited(process):
        if process.pid not in _terminated:
            # os.kill, not Popen.terminate: that polls first, and could reap the process.
            os.kill(process.pid, signal.SIGTERM)
        if not _wait_exited(process, timeout_s):
            os.kill(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        if process.returncode is None and os.getpgid(process.pid) == process.pid:  # leads its group
            end_group(process.pid)  # still unreaped, so the group id is still ours
    _terminated.discard(process.pid)
    return process.wait()


def keep_running(launched: Launched, seconds: float | None, name: str = "the process") -> None:
    """Return after `seconds` (never, if None: until a signal unwinds the caller);
    LaunchError, with the log's tail, if the process exits meanwhile."""
    deadline = time.monotonic() + seconds if seconds else float("inf")
    while time.monotonic() < deadline:
        if exited(launched.process):
            raise LaunchError(f"{name} exited with {stop_process(launched.process)}; "
                              f"log {launched.log_path}:\n{launched.log_tail()}")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
