"""deploy/fleet.py on a local Ray cluster: the proxy comes up with no server, the planner
starts the first three as Ray actors and they join it by registering; with no traffic
the planner stops one it no longer needs (drained first), never going below
`--min-instances`; a request through the proxy succeeds; SIGTERM to the script stops the
planner, which stops every server it started, and leaves no server running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launch import free_port, http_client
from tests.support.processes import EXIT_TIMEOUT_S, accepts, alive, pids, serving_port, stop
from tests.support.server_harness import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
READY_TIMEOUT_S = 240.0


def test_fleet_py_starts_its_servers_on_ray_shrinks_to_what_it_needs_and_stops_them_all(tmp_path, tiny_models) -> None:
    urls_file, log_path, log_dir = tmp_path / "urls.json", tmp_path / "fleet.log", tmp_path / "logs"
    cmd = [sys.executable, str(ROOT / "deploy" / "fleet.py"), "--model", str(tiny_models["qwen3"]), "--ttft-slo", "5",
           "--tpot-slo", "1", "--start-prefill", "2", "--start-decode", "1", "--min-instances", "2",
           "--max-instances", "3", "--cpus-per-server", "0.5", "--port", str(free_port()), "--urls-file",
           str(urls_file), "--log-dir", str(log_dir), "--planner-args",
           "--interval 0.5 --patience 2 --cooldown 1 --scale-down-after 1",
           "--", "--num-threads", "1", "--drain-timeout", "2"]
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN", RAY_USAGE_STATS_ENABLED="0")
    env.pop("PD_PROXY_ADMIN_KEY", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    try:
        assert wait_until(lambda: urls_file.exists() or process.poll() is not None, READY_TIMEOUT_S)
        assert urls_file.exists(), log_path.read_text()[-6000:]
        urls = json.loads(urls_file.read_text())
        assert {httpx.URL(s["url"]).host for s in urls["servers"]} == {"127.0.0.1"}  # the suite stays on loopback
        assert sorted(s["role"] for s in urls["servers"]) == ["decode", "prefill", "prefill"]
        key = (log_dir / "admin-key").read_text().strip()
        assert oct((log_dir / "admin-key").stat().st_mode & 0o777) == "0o600"

        def fleet() -> dict:
            return http_client().get(f"{urls['proxy']}/admin/instances", timeout=10,
                                     headers={"Authorization": f"Bearer {key}"}).json()

        assert wait_until(lambda: len(fleet()["instances"]) == 2, 90), fleet()
        state = fleet()
        assert sorted(i["role"] for i in state["instances"]) == ["decode", "prefill"]
        (remove,) = [d for d in state["decisions"] if d["action"] == "remove"]
        (gone,) = {s["url"] for s in urls["servers"]} - {i["url"] for i in state["instances"]}
        assert remove["url"] == gone and wait_until(lambda: not accepts(gone), 30)
        response = http_client().post(f"{urls['proxy']}/v1/completions", timeout=120,
                                      json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert http_client().get(f"{urls['proxy']}/admin/instances", timeout=10).status_code == 401

        ports = [httpx.URL(s["url"]).port for s in urls["servers"]]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log_path.read_text()[-6000:]
    finally:
        stop(process)
    assert "stopping the 2 server(s) the launcher started" in (log_dir / "planner.log").read_text()
    assert not any(accepts(url) for url in [urls["proxy"], *(s["url"] for s in urls["servers"])])
    deadline = time.monotonic() + 10
    while (left := [p for p in pids() if alive(p) and any(serving_port(p, port) for port in ports)]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "a server the planner started outlived the fleet"
