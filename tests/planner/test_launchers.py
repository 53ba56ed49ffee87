"""The launchers' bookkeeping (planner/launchers.py), on real processes that are not
servers: a server that exits by itself is forgotten with its log's tail; one starting is
counted by the planner but never moved; one stopping is neither stoppable nor starting;
a launcher without the deployment's secret refuses to start."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launch.process import start_logged
from planner.launchers import LauncherError, LocalLauncher, Started, with_launched
from planner.policy import Member
from wire.fleet import SECRET_ENV


@pytest.fixture
def launcher(tmp_path, monkeypatch) -> LocalLauncher:
    monkeypatch.setenv(SECRET_ENV, "a-secret")
    return LocalLauncher("http://127.0.0.1:1", "no-model", [], tmp_path)


def process(tmp_path, name: str, code: str) -> tuple[subprocess.Popen, str]:
    log = tmp_path / f"{name}.log"
    return start_logged([sys.executable, "-c", code], log), str(log)


def test_a_server_that_exits_by_itself_is_forgotten_with_its_logs_tail(launcher, tmp_path) -> None:
    gone, gone_log = process(tmp_path, "gone", "print('engine failed: out of memory'); raise SystemExit(1)")
    alive, alive_log = process(tmp_path, "alive", "import time; time.sleep(60)")
    launcher.started = {"http://127.0.0.1:2": Started("http://127.0.0.1:2", "decode", gone, gone_log),
                        "http://127.0.0.1:3": Started("http://127.0.0.1:3", "prefill", alive, alive_log)}
    try:
        deadline = time.monotonic() + 10
        while (lines := launcher.reap()) == [] and time.monotonic() < deadline:
            time.sleep(0.05)
        (line,) = lines
        assert line.startswith("http://127.0.0.1:2 (decode) exited by itself") and "out of memory" in line
        assert set(launcher.started) == {"http://127.0.0.1:3"} and launcher.reap() == []
    finally:
        launcher.close()
    assert alive.poll() is not None and launcher.started == {}


def test_one_starting_is_counted_and_never_moved_one_stopping_is_neither(launcher, tmp_path) -> None:
    starting, log = process(tmp_path, "starting", "import time; time.sleep(60)")
    listed, log2 = process(tmp_path, "listed", "import time; time.sleep(60)")
    launcher.started = {"http://127.0.0.1:4": Started("http://127.0.0.1:4", "prefill", starting, log),
                        "http://127.0.0.1:5": Started("http://127.0.0.1:5", "decode", listed, log2)}
    try:
        members = with_launched([Member("http://127.0.0.1:5", "decode", ("prefill", "decode")),
                                 Member("http://127.0.0.1:6", "decode", ("prefill", "decode"))], launcher)
        by_url = {m.url: m for m in members}
        assert by_url["http://127.0.0.1:5"].stoppable and not by_url["http://127.0.0.1:6"].stoppable
        joining = by_url["http://127.0.0.1:4"]
        assert (joining.role, joining.switchable, joining.stoppable, joining.starting) == ("prefill", False, False,
                                                                                          True)
        assert not by_url["http://127.0.0.1:5"].starting
        launcher.stop("http://127.0.0.1:4")
        assert launcher.stoppable() == {"http://127.0.0.1:5"}  # 4 is stopping, or stopped and forgotten
        assert launcher.starting(set()) == [launcher.started["http://127.0.0.1:5"]]
    finally:
        launcher.close()


def test_a_launcher_without_the_deployments_secret_refuses(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(LauncherError, match=SECRET_ENV):
        LocalLauncher("http://127.0.0.1:1", "no-model", [], tmp_path)
