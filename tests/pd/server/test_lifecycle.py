"""`pd serve` as a process: it stops its engine on SIGTERM; when its engine dies it fails
what was in flight and exits 1, or starts a new engine (`--restart-engine`); it removes
IPC folders of servers killed before it; and it fails cleanly at startup."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cli.main import main
from launch import http_client
from tests.support.server_harness import running_server, stop_process, wait_until

pytestmark = pytest.mark.slow

DEATH_DEADLINE_S = 5.0


def process_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.05)
    return False


def test_sigterm_stops_the_server_and_its_engine(tiny_models, tmp_path) -> None:
    with running_server(tiny_models["bamba"], tmp_path / "server.log") as server:
        engine_pid = server.health().json()["engine_pid"]
        assert engine_pid != server.process.pid and not process_gone(engine_pid, 0.1)
        assert "ready at http://127.0.0.1:" in server.log_tail()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(20) == 0, server.log_tail()
        assert process_gone(engine_pid, 5.0), "the engine core outlived its server"


def test_engine_death_fails_its_requests_and_the_server_exits_1(tiny_models, tmp_path) -> None:
    """Row 8 of issue 31: with its engine killed the server stayed up answering 503
    forever, so no supervisor restarted it. Now it fails what was in flight (500
    engine_died: the request may be what killed it, so the proxy does not retry it
    elsewhere) and exits 1."""
    with running_server(tiny_models["qwen3"], tmp_path / "server.log") as server:
        engine_pid = server.health().json()["engine_pid"]
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        # the client's read timeout bounds how long the stream may go on after the kill
        with http_client().stream("POST", f"{server.url}/v1/completions", json=body,
                                  timeout=DEATH_DEADLINE_S) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(engine_pid, signal.SIGKILL)  # a child of the server this test started
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_died"
        assert server.process.wait(30) == 1, server.log_tail()
        assert "stopping the server (exit code 1)" in server.log_tail()


def test_with_restart_engine_a_new_engine_serves_and_past_the_limit_the_server_exits_1(tiny_models, tmp_path) -> None:
    with running_server(tiny_models["qwen3"], tmp_path / "server.log", "--restart-engine", "1") as server:
        body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        expected = http_client().post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        first = server.health().json()["engine_pid"]
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: server.health().status_code == 200 and server.health().json()["engine_pid"] != first,
                          60), server.log_tail()
        answer = http_client().post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"] == expected["choices"]
        assert server.metrics()["pd_engine_restarts_total"] == 1
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
        os.kill(server.health().json()["engine_pid"], signal.SIGKILL)  # past its one restart
        assert server.process.wait(30) == 1, server.log_tail()


def test_an_ipc_folder_left_by_a_killed_server_is_removed_when_the_next_starts(tiny_models, tmp_path,
                                                                              monkeypatch) -> None:
    # The servers' temp directory is this test's own: a server another worker starts
    # meanwhile would remove the killed server's folder before the test looks at it. A
    # short path (not under tmp_path): an ipc:// socket path holds at most 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="pd-t-"))
    monkeypatch.setenv("TMPDIR", str(temp))

    def folders(pid: int) -> list[Path]:
        return list(temp.glob(f"pd-engine-{pid}-*"))

    try:
        with running_server(tiny_models["qwen3"], tmp_path / "a.log") as killed:
            assert len(folders(killed.process.pid)) == 1
            engine_pid = killed.health().json()["engine_pid"]
            killed.process.kill()  # no chance to remove its folder; its engine exits as an orphan
            killed.process.wait(10)
            assert process_gone(engine_pid, 10)
            assert len(folders(killed.process.pid)) == 1
        with running_server(tiny_models["qwen3"], tmp_path / "b.log") as server:
            assert folders(killed.process.pid) == [] and len(folders(server.process.pid)) == 1
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_engine_startup_failure_exits_1_with_the_reason(tiny_models, tmp_path) -> None:
    cmd = [str(Path(sys.executable).parent / "pd"), "serve", "--model", str(tiny_models["qwen3"]),
           "--port", "1", "--kv-cache-memory", "4096"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = process.communicate(timeout=120)
    finally:
        stop_process(process)
    assert process.returncode == 1
    assert "engine core failed to start" in out and "KV cache memory" in out


def test_bad_flags_are_refused_before_anything_starts(tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path), "--role", "wizard"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit, match="not a model directory: no config.json"):
        main(["serve", "--model", str(tmp_path)])


def test_a_port_in_use_fails_before_any_engine_starts(tiny_models, tmp_path) -> None:
    """The port is bound first: a taken one is refused at once, with no engine spawned
    (the listening socket is held from then on, so no other process's free-port pick
    can take it while the engine loads)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([str(Path(sys.executable).parent / "pd"), "serve", "--model", str(tiny_models["qwen3"]),
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "engine" not in done.stderr.lower()


def test_a_prefill_or_decode_server_without_a_transfer_secret_is_refused_before_anything_starts(tiny_models) -> None:
    """Issue 31 row 6: secure by default (the deploy scripts and benchmarks make a secret)."""
    for role in ("prefill", "decode"):
        with pytest.raises(SystemExit, match="needs a transfer secret"):
            main(["serve", "--model", str(tiny_models["qwen3"]), "--role", role, "--kv-transfer-secret", ""])
