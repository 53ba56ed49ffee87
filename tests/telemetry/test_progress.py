"""telemetry/progress.py: a redrawn bar on a terminal (a real pseudo-terminal here), a few
plain lines with counts and no carriage return anywhere else."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import select
import struct
import termios

from telemetry.progress import MAX_LINES, Progress, is_terminal


def read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_a_bar_is_redrawn_in_place() -> None:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size: 24x100
    try:
        with open(slave, "w", closefd=True) as terminal:
            assert is_terminal(terminal)
            with Progress("loading weights", 50, "tensors", stream=terminal) as progress:
                for _ in progress.track(range(50)):
                    pass
            terminal.flush()
            drawn = read_all(master)
    finally:
        os.close(master)
    assert re.search(r"\r(?!\n)", drawn)  # a redraw, not the terminal's \r\n for a newline
    assert "loading weights" in drawn and "50/50" in drawn and "100%" in drawn
    assert "in " not in drawn.rsplit("\r", 1)[-1]  # no plain final line: the bar's last draw


def test_elsewhere_plain_lines_with_counts_and_no_carriage_return() -> None:
    log = io.StringIO()
    with Progress("loading weights", 300, "tensors", stream=log) as progress:
        for _ in range(300):
            progress.update()
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert lines[0].startswith("loading weights: 30/300 tensors (10%, ")
    assert lines[3].startswith("loading weights: 120/300 tensors (40%, ")
    assert re.fullmatch(r"loading weights: 300/300 tensors \(100%\) in \d+\.\d s", lines[-1])
    assert len(lines) == MAX_LINES  # nine steps and the final line


def test_plain_lines_stay_few_however_many_updates() -> None:
    log = io.StringIO()
    with Progress("requests", 100_000, stream=log, lines=4) as progress:
        for _ in progress.track(range(100_000)):
            pass
    counts = [int(m) for m in re.findall(r"requests: (\d+)/100000", log.getvalue())]
    assert counts == [25_000, 50_000, 75_000, 100_000]


def test_big_updates_skip_the_steps_they_pass() -> None:
    log = io.StringIO()
    progress = Progress("servers healthy", 4, stream=log)
    progress.update(3)
    progress.update(1)
    progress.close()
    progress.close()  # once only
    assert [line.split(" (")[0] for line in log.getvalue().splitlines()] == [
        "servers healthy: 3/4", "servers healthy: 4/4"]


def test_a_closed_early_job_ends_with_the_count_it_reached() -> None:
    log = io.StringIO()
    try:
        with Progress("converting", 10, "tensors", stream=log) as progress:
            progress.update(2)
            raise RuntimeError("disk full")
    except RuntimeError:
        pass
    assert log.getvalue().splitlines()[-1].startswith("converting: 2/10 tensors (20%) in ")


def test_disabled_progress_shows_nothing() -> None:
    log = io.StringIO()
    with Progress("loading weights", 3, stream=log, enabled=False) as progress:
        progress.update(3)
    assert log.getvalue() == ""


def test_importing_progress_costs_no_httpx_nor_tqdm() -> None:
    """The engine imports it to show its weights loading: the launcher's httpx stays out,
    tqdm waits for a terminal."""
    import subprocess
    import sys

    script = "import sys; import telemetry.progress; print(sorted({'httpx', 'tqdm'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_where_logs_are_json_its_lines_are_log_records(monkeypatch) -> None:
    """`pd serve --log-format json` (and the engine it starts): every line of stderr is one
    JSON object, the progress too."""
    from telemetry import logs

    records = []
    monkeypatch.setenv(logs.ENV_FORMAT, "json")
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(logging.getLogger(), "level", logging.INFO)
    with Progress("loading weights", 4, "tensors") as progress:  # stderr, the default
        progress.update(4)
    assert [r.getMessage() for r in records][-1].startswith("loading weights: 4/4 tensors (100%) in ")
    assert {r.name for r in records} == {"pd.progress"}
    text = io.StringIO()
    with Progress("converting", 2, stream=text) as progress:  # a stream given: written to it as it is
        progress.update(2)
    assert text.getvalue().startswith("converting: 2/2") and len(records) == 1
