"""`free_port` hands a port out once machine-wide, and from where the kernel hands out
none: between the pick and the server's bind, a port was once picked again (a deployment's
HTTP and KV events ports were the same) and once taken by another process's listener on
port 0 (a TP rank port), each failing a server's start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from launch import http_client, ports, running
from launch.ports import read_port, write_port


@pytest.fixture
def picks(monkeypatch, tmp_path):
    """The kernel's picks, scripted; reservations in a directory of the test's own."""
    script: list[int] = []
    monkeypatch.setattr(ports, "pick_port", lambda host: script.pop(0))
    monkeypatch.setattr(ports, "reservations_dir", lambda: tmp_path)
    return script


def test_a_port_the_kernel_picks_twice_is_handed_out_once(picks) -> None:
    picks.extend([40001, 40001, 40001, 40003])
    assert [ports.free_port(), ports.free_port()] == [40001, 40003]


def test_a_port_another_process_was_handed_is_skipped(picks, tmp_path) -> None:
    code = ("import sys; from pathlib import Path; from launch import ports; "
            "ports.pick_port = lambda host: 40005; ports.reservations_dir = lambda: Path(sys.argv[1]); "
            "print(ports.free_port())")
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert other.stdout.split() == ["40005"]
    picks.extend([40005, 40007])
    assert ports.free_port() == 40007


def test_a_stale_reservation_is_taken_over_and_a_fresh_one_is_not(tmp_path) -> None:
    stale = tmp_path / "40009"
    stale.touch()
    old = time.time() - ports.RESERVATION_S - 1
    os.utime(stale, (old, old))
    assert ports.reserve(40009, tmp_path, time.time())
    assert time.time() - stale.stat().st_mtime < ports.RESERVATION_S
    assert not ports.reserve(40009, tmp_path, time.time())


def test_stale_reservations_are_swept_once_a_process(tmp_path) -> None:
    old = time.time() - ports.RESERVATION_S - 1
    for port in (40013, 40015):
        (tmp_path / str(port)).touch()
    os.utime(tmp_path / "40013", (old, old))
    ports.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["40015"]


def test_no_unreserved_port_is_an_error_naming_the_directory(picks, tmp_path) -> None:
    (tmp_path / "40011").touch()
    picks.extend([40011] * ports.TRIES)
    with pytest.raises(OSError, match=str(tmp_path)):
        ports.free_port()


def test_a_port_in_use_is_not_picked(picks) -> None:
    picks.extend([None, None, 40017])  # pick_port: the ports it tried were in use
    assert ports.free_port() == 40017


@pytest.mark.parametrize(("content", "expected"), [("32768\t60999\n", range(20000, 32768)),
                                                   ("21000 60999", None), ("", None), (None, None)])
def test_ports_are_picked_below_the_kernels_ephemeral_range(monkeypatch, tmp_path, content, expected) -> None:
    path = tmp_path / "ip_local_port_range"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", path)
    ports.candidates.cache_clear()
    try:
        assert ports.candidates() == expected
    finally:
        ports.candidates.cache_clear()


def test_pick_port_tries_one_candidate_and_says_none_if_it_is_taken(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports, "candidates", lambda: range(port, port + 1))
        assert ports.pick_port("127.0.0.1") is None
    assert ports.pick_port("127.0.0.1") == port


def test_real_picks_are_distinct_bindable_and_outside_the_kernels_range() -> None:
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    if ports.candidates() is not None:  # this machine's range leaves room below it
        assert all(p in ports.candidates() for p in picked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


SERVE_ON_ANY_PORT = """
import http.server, sys
from launch.ports import listen

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", 0), Health, bind_and_activate=False)
server.socket = listen("127.0.0.1", 0, sys.argv[1])
server.serve_forever()
"""


def test_a_server_on_a_port_the_kernel_picks_is_found_by_its_port_file(tmp_path) -> None:
    """No port is picked before the server binds it: it binds port 0 and writes what it got;
    the launcher reads it before waiting for /health."""
    port_file = tmp_path / "server.port"
    port_file.write_text("1\n")  # a stale one of a last run: removed at start
    cmd = [sys.executable, "-c", SERVE_ON_ANY_PORT, str(port_file)]
    with running(cmd, "http://127.0.0.1:{port}", tmp_path / "server.log", port_file=port_file) as launched:
        port = read_port(port_file)
        assert port is not None and port != 1 and launched.url == f"http://127.0.0.1:{port}"
        assert http_client().get(f"{launched.url}/health", timeout=5).status_code == 200


def test_a_port_file_is_read_only_once_whole(tmp_path) -> None:
    path = tmp_path / "p.port"
    assert read_port(path) is None  # not written yet
    path.write_text("")  # being written (write_port renames a whole file into place: never seen so)
    assert read_port(path) is None
    write_port(path, 34567)
    assert read_port(path) == 34567 and [p.name for p in tmp_path.iterdir()] == ["p.port"]
