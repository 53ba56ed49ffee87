"""A server whose rank 1 runs "on another node": `pd serve --tp-local-ranks 1 --tp-port P`
starts rank 0 only, and `pd tp-rank --join 127.0.0.1:P --rank 1` (a process the server did
not start) joins it over TCP. Intruders on the join port are refused while the server
goes on waiting; once joined the server answers TP = 1's tokens; a rank killed mid-run
stops the server cleanly, and a rank whose server stops ends by itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from launch import free_port, pd_command, stop_process, wait_started
from launch.process import SECRET_ENV, deployment_secret, start_logged
from tests.support.pd_client import choices
from tests.support.server_harness import running_server, wait_until
from tests.support.tp_processes import alive, stream_until_error

pytestmark = pytest.mark.slow

BODY = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def start_rank(port: int, rank: int, log: Path, secret: str) -> subprocess.Popen:
    env = {**os.environ, SECRET_ENV: secret}
    return start_logged(pd_command("tp-rank", "--join", f"127.0.0.1:{port}", "--rank", str(rank),
                                   "--join-timeout", "120"), log, env)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def remote_tp2(model: Path, tmp_path: Path, tp_port: int, *args: str):
    return running_server(model, tmp_path / "server.log", "--tensor-parallel-size", "2", "--tp-local-ranks", "1",
                          "--tp-port", str(tp_port), *args, wait=False)


def test_a_rank_from_another_node_joins_past_intruders_and_serves_tp1_tokens(tiny_models, colocated,
                                                                           tmp_path) -> None:
    secret = deployment_secret()
    single = colocated["qwen3"]
    expected = [choices(single, BODY), choices(single, {**BODY, "stream": True}, streamed=True)]
    tp_port = free_port()
    processes: list[subprocess.Popen] = []
    try:
        with remote_tp2(tiny_models["qwen3"], tmp_path, tp_port) as server:
            assert wait_until(lambda: accepts(tp_port), 120), server.log_tail()
            with socket.create_connection(("127.0.0.1", tp_port)) as garbage:
                garbage.sendall(os.urandom(512))
            for rank, key, why in ((1, "not the secret", "wrong"), (5, secret, "unawaited")):
                intruder = start_rank(tp_port, rank, tmp_path / f"{why}.log", key)
                processes.append(intruder)
                assert intruder.wait(60) == 1
                assert f"refused rank {rank}" in (tmp_path / f"{why}.log").read_text()
            rank = start_rank(tp_port, 1, tmp_path / "rank1.log", secret)
            processes.append(rank)
            wait_started(server)
            assert [choices(server, BODY), choices(server, {**BODY, "stream": True}, streamed=True)] == expected
            assert server.metrics()['pd_kv_cache_bytes{rank="1"}'] > 0
            assert server.log_tail().count("refused a tensor-parallel rank connection") >= 3
        assert rank.wait(30) == 0, "the rank did not end with its server"
    finally:
        for process in processes:
            stop_process(process)


def test_a_remote_rank_killed_mid_run_stops_the_server_cleanly(tiny_models, tmp_path) -> None:
    tp_port = free_port()
    rank = start_rank(tp_port, 1, tmp_path / "rank1.log", deployment_secret())
    try:
        with remote_tp2(tiny_models["qwen3"], tmp_path, tp_port, "--tp-timeout", "3") as server:
            wait_started(server)
            engine_pid = server.health().json()["engine_pid"]
            start = time.monotonic()
            events = stream_until_error(server, engine_pid, lambda: os.kill(rank.pid, signal.SIGKILL))
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_died"
            assert time.monotonic() - start < 30
            assert server.process.wait(30) == 1, server.log_tail()
            assert wait_until(lambda: not alive(engine_pid), 10), "the engine was left behind"
            # a collective, the step's hand-off or its report finds the rank gone: whichever came first
            log = server.log_path.read_text()
            assert "the engine core failed: RankLost: " in log, log[-4000:]
    finally:
        stop_process(rank)


def test_a_rank_without_the_secret_does_not_try_to_join() -> None:
    env = {name: value for name, value in os.environ.items() if name != SECRET_ENV}
    out = subprocess.run(pd_command("tp-rank", "--join", "127.0.0.1:9", "--rank", "1"), env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 1 and f"set {SECRET_ENV}" in out.stderr
