"""deploy/ray_pd.py on a local Ray cluster: one prefill and one decode server come up as
Ray actors, a request through the proxy succeeds, and SIGINT / SIGTERM to the script
leaves none of the servers (nor the processes under them) running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from launch import free_port, http_client
from pd.models.make_model import make_model
from tests.support.processes import (
    EXIT_TIMEOUT_S,
    accepts,
    alive,
    argv,
    descendants,
    pids,
    serving_port,
    stop,
    wait_until_gone,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
READY_TIMEOUT_S = 240.0



@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("qwen3", tmp_path_factory.mktemp("ray-pd-model") / "qwen3", seed=1)


def wait_for_urls(process: subprocess.Popen, urls_file: Path, log_path: Path) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not urls_file.exists():
        assert process.poll() is None, f"ray_pd.py exited with {process.returncode}:\n{log_path.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"no {urls_file} after {READY_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}"
        time.sleep(0.5)
    urls = json.loads(urls_file.read_text())
    nodes = {entry["node_ip"] for entry in urls["servers"] + urls.get("ranks", [])}
    assert nodes == {"127.0.0.1"}, f"Ray put servers on {nodes}: the suite's traffic stays on loopback"
    return urls


def test_ray_pd_refuses_fewer_than_one_server(tiny_qwen3) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "deploy" / "ray_pd.py"), "--prefill", "0", "--decode", "1",
                          "--model", str(tiny_qwen3)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--prefill: must be at least 1, got 0" in out.stderr


def test_ray_pd_serves_through_the_proxy_and_sigterm_stops_every_server(tmp_path, tiny_qwen3) -> None:
    """(SIGINT: the test below.)"""
    urls_file, log_path = tmp_path / "urls.json", tmp_path / "ray_pd.log"
    cmd = [sys.executable, str(ROOT / "deploy" / "ray_pd.py"), "--prefill", "1", "--decode", "1", "--decode-tp", "2",
           "--model", str(tiny_qwen3), "--num-threads", "1", "--port", str(free_port()),
           "--urls-file", str(urls_file), "--log-dir", str(tmp_path / "logs")]
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN", RAY_USAGE_STATS_ENABLED="0")
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    try:
        urls = wait_for_urls(process, urls_file, log_path)
        print(f"ray_pd.py up in {time.monotonic() - started:.1f} s")
        assert len(urls["prefill"]) == 1 and len(urls["decode"]) == 1
        progress = [line for line in log_path.read_text().splitlines() if line.startswith("ray_pd: servers healthy")]
        assert progress and progress[-1].startswith("ray_pd: servers healthy: 2/2 (100%) in ")  # plain, in a log
        response = http_client().post(f"{urls['proxy']}/v1/completions", timeout=120,
                                      json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        servers = urls["servers"]
        assert all(accepts(s["url"]) for s in servers)
        ports = [s["port"] for s in servers]
        server_pids = {pid for pid in pids() if any(serving_port(pid, port) for port in ports)}
        assert server_pids == {s["pid"] for s in servers}  # what the actors reported, found in /proc
        ours = descendants(process.pid)  # Ray's processes, the actors, the servers, their engines, the proxy
        server_trees = server_pids | {d for pid in server_pids for d in descendants(pid)}

        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log_path.read_text()[-6000:]
        print(f"ray_pd.py stopped in {time.monotonic() - stopping:.1f} s")
    finally:
        stop(process)

    assert not any(accepts(url) for url in [urls["proxy"], *(s["url"] for s in servers)])
    assert not [pid for pid in pids() if alive(pid) and any(serving_port(pid, port) for port in ports)]
    assert not wait_until_gone(server_trees, 10), "a server's engine process outlived it"
    # ray.shutdown() stops the local cluster ray.init() started; its processes may take a moment.
    if left := wait_until_gone(ours, 30):
        warnings.warn(f"Ray processes left after ray.shutdown(): {[' '.join(argv(p))[:120] for p in left]}",
                      stacklevel=1)


def test_ray_pd_spreads_a_servers_ranks_over_nodes(tmp_path, tiny_qwen3, monkeypatch) -> None:
    """Three Ray nodes of one CPU each (a test cluster on this machine): with
    `--tp-span-nodes`, the decode server's two ranks cannot share a node, so rank 1 runs
    on another node as a `pd tp-rank` actor that joins over TCP; a request is served, and
    SIGINT (Ctrl-C) to the script ends the rank with its server."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # the test cluster's nodes on 127.0.0.1: told here, and by the variable to the processes Ray starts
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    node = {"num_cpus": 1, "object_store_memory": 80 * 1024**2, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    urls_file, log_path = tmp_path / "urls.json", tmp_path / "ray_pd.log"
    process = None
    try:
        for _ in range(2):
            cluster.add_node(**node)
        cmd = [sys.executable, str(ROOT / "deploy" / "ray_pd.py"), "--address", cluster.address, "--prefill", "1",
               "--decode", "1", "--decode-tp", "2", "--tp-span-nodes", "--cpus-per-server", "1",
               "--model", str(tiny_qwen3), "--num-threads", "1", "--port", str(free_port()),
               "--urls-file", str(urls_file), "--log-dir", str(tmp_path / "logs")]
        with open(log_path, "w") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=dict(os.environ, NIXL_LOG_LEVEL="WARN"), start_new_session=True)
        urls = wait_for_urls(process, urls_file, log_path)
        (decode,) = [s for s in urls["servers"] if s["role"] == "decode"]
        (rank,) = urls["ranks"]
        assert rank["server"] == decode["url"] and rank["rank"] == 1
        assert rank["node_id"] != decode["node_id"], "the ranks were not spread over nodes"
        response = http_client().post(f"{urls['proxy']}/v1/completions", timeout=120,
                                      json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log_path.read_text()[-6000:]
        assert not wait_until_gone({rank["pid"], decode["pid"]}, 30), "a rank or server outlived the deployment"
    finally:
        if process is not None:
            stop(process)
        cluster.shutdown()
