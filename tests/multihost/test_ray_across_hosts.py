"""deploy/ray_pd.py on a Ray cluster of three hosts (launch/hosts.py): the head on host 0,
worker nodes on hosts 1 and 2, one CPU each, so that every server rank has a node of its
own. 1P1D with the decode server's two tensor-parallel ranks on two nodes
(`--decode-tp 2 --tp-span-nodes`): P, D's rank 0 and D's rank 1 each on another host,
KV read over TCP, the ranks' collectives (gloo) over TCP between two hosts. Through the
proxy (on the head's host) every answer equals a colocated one-rank server's; SIGTERM to
the script leaves nothing it started running on any host, and the Ray nodes stop with
the network."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch import hosts, http_client
from launch.hosts import Network
from tests.support.host_listeners import listening
from tests.support.pd_client import complete
from tests.support.processes import alive, argv

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")]
ROOT = Path(__file__).parents[2]
RAY = str(Path(sys.executable).parent / "ray")
GCS_PORT = 6379
READY_S = 240.0
PROMPTS = ["The keeper of the lighthouse wrote down every ship that passed. ",
           "Counting: one, two, three, four, five, six, seven, eight, nine, ten,"]


def body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray-hosts")
    env = hosts.host_env() | {"RAY_USAGE_STATS_ENABLED": "0", "NIXL_LOG_LEVEL": "WARN",
                              # the cluster's token (Ray asks for one), on every node and the driver
                              "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    temps: list[Path] = []
    with contextlib.ExitStack() as cleanup, Network(3) as net:  # the nodes stop, then their files go
        cleanup.callback(lambda: [shutil.rmtree(temp, ignore_errors=True) for temp in temps])
        head = net.hosts[0]

        def node(host: hosts.Host, *args: str) -> None:
            """A Ray node in `host`, with a directory of its own (the hosts share a file
            system: nodes in one /tmp/ray took each other's session files)."""
            temp = Path(tempfile.mkdtemp(prefix="pdray-"))  # short: Ray's socket paths live under it
            temps.append(temp)
            with open(logs / f"ray-{host.address}.log", "w") as log:
                net.popen(host, [RAY, "start", "--node-ip-address", host.address, "--num-cpus", "1", "--block",
                                 "--disable-usage-stats", "--temp-dir", str(temp), *args], env=env, stdout=log,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

        def nodes_up() -> int:
            status = net.popen(head, [RAY, "status", "--address", f"{head.address}:{GCS_PORT}"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            out = status.communicate(timeout=60)[0]
            active = out.partition("Active:")[2].partition("Pending:")[0]
            return active.count("node_")

        deadline = time.monotonic() + READY_S
        node(head, "--head", "--port", str(GCS_PORT), "--include-dashboard=false")
        for wanted, worker in enumerate(net.hosts[1:], start=1):
            while nodes_up() < wanted:  # the head's GCS first, then one node at a time
                assert time.monotonic() < deadline, f"the Ray nodes did not all join; logs in {logs}"
                time.sleep(1)
            node(worker, "--address", f"{head.address}:{GCS_PORT}")
        while nodes_up() < len(net.hosts):
            assert time.monotonic() < deadline, f"the Ray nodes did not all join; logs in {logs}"
            time.sleep(1)
        yield {"net": net, "env": env, "logs": logs}


def wait_for_urls(script: subprocess.Popen, urls_file: Path, log_path: Path) -> dict:
    """The URLs file a deploy script writes once its servers are up."""
    deadline = time.monotonic() + READY_S + 60
    while not urls_file.exists():
        assert script.poll() is None, f"it exited with {script.returncode}:\n{log_path.read_text()[-6000:]}"
        assert time.monotonic() < deadline, log_path.read_text()[-6000:]
        time.sleep(0.5)
    return json.loads(urls_file.read_text())


def assert_nothing_of_ours_left(net: Network) -> None:
    """What runs in the hosts is Ray's nodes alone: no server or rank, on any host."""
    for host in net.hosts:
        left = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, check=True).stdout
        ours = [argv(int(pid)) for pid in left.split() if alive(int(pid)) and "cli.main" in argv(int(pid))]
        assert not ours, (host.name, ours)


def test_1p1d_with_a_decode_server_over_two_nodes_serves_as_colocated(cluster, tiny_models, colocated,
                                                                      tmp_path) -> None:
    net, head = cluster["net"], cluster["net"].hosts[0]
    expected = [complete(colocated["qwen3"], body(p)).token_ids for p in PROMPTS]
    urls_file, log_path = tmp_path / "urls.json", tmp_path / "ray_pd.log"
    with open(log_path, "w") as log:
        script = net.popen(head, [sys.executable, str(ROOT / "deploy" / "ray_pd.py"), "--address",
                                  f"{head.address}:{GCS_PORT}", "--prefill", "1", "--decode", "1", "--decode-tp", "2",
                                  "--tp-span-nodes", "--cpus-per-server", "1", "--model", str(tiny_models["qwen3"]),
                                  "--num-threads", "1", "--port", "8000", "--urls-file", str(urls_file),
                                  "--log-dir", str(tmp_path / "logs"), "--ready-timeout", str(READY_S)],
                           env=cluster["env"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           start_new_session=True, cwd=ROOT)
    urls = wait_for_urls(script, urls_file, log_path)
    placed = {entry.get("role", f"rank {entry.get('rank')}"): entry["node_ip"]
              for entry in urls["servers"] + urls["ranks"]}
    assert sorted(placed.values()) == sorted(h.address for h in net.hosts), placed  # a host each
    pids = [entry["pid"] for entry in urls["servers"] + urls["ranks"]]

    def ask(prompt: str) -> list[int]:
        response = http_client().post(f"{urls['proxy']}/v1/completions", json=body(prompt), timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers.get("x-pd-path") == "disaggregated"
        return response.json()["choices"][0]["token_ids"]

    assert [net.call(head, ask, prompt) for prompt in PROMPTS] == expected
    (rank,) = urls["ranks"]  # D's rank 1, on a node of its own: its NIXL agent and gloo on that node's address
    rank_host = next(h for h in net.hosts if h.address == rank["node_ip"])
    addresses = {address for address, _ in listening(rank_host, rank["pid"])}
    assert addresses == {rank_host.address}, addresses
    d = next(s for s in urls["servers"] if s["role"] == "decode")
    text = net.call(head, lambda: http_client().get(f"{d['url']}/metrics", timeout=10).text)
    assert 'pd_kv_transfer_bytes_by_path_total{path="tcp"}' in text

    os.kill(script.pid, signal.SIGTERM)
    assert script.wait(120) == 0, log_path.read_text()[-6000:]
    assert not [pid for pid in pids if alive(pid)]  # every server and rank, on every host
    assert_nothing_of_ours_left(net)


def test_the_fleet_launcher_puts_prefill_and_decode_on_nodes_of_their_own(cluster, tiny_models, colocated,
                                                                         tmp_path) -> None:
    """deploy/fleet.py (the planner's Ray launcher): its first P and D each take a node's
    one CPU, register with the proxy on the head's address, and serve as colocated;
    SIGTERM stops them all."""
    net, head = cluster["net"], cluster["net"].hosts[0]
    expected = complete(colocated["qwen3"], body(PROMPTS[0])).token_ids
    urls_file, log_path = tmp_path / "urls.json", tmp_path / "fleet.log"
    with open(log_path, "w") as log:
        script = net.popen(head, [sys.executable, str(ROOT / "deploy" / "fleet.py"), "--address",
                                  f"{head.address}:{GCS_PORT}", "--model", str(tiny_models["qwen3"]), "--ttft-slo", "5",
                                  "--tpot-slo", "1", "--start-prefill", "1", "--start-decode", "1", "--min-instances",
                                  "2", "--max-instances", "2", "--cpus-per-server", "1", "--host", head.address,
                                  "--port", "8001", "--fleet-allow", "198.18.0.0/24", "--urls-file", str(urls_file),
                                  "--log-dir", str(tmp_path / "logs"), "--", "--num-threads", "1"],
                           env=cluster["env"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           start_new_session=True, cwd=ROOT)
    urls = wait_for_urls(script, urls_file, log_path)
    nodes = {s["role"]: s["url"].split("//")[1].rpartition(":")[0] for s in urls["servers"]}
    assert set(nodes) == {"prefill", "decode"} and nodes["prefill"] != nodes["decode"], nodes

    def ask() -> list[int]:
        response = http_client().post(f"{urls['proxy']}/v1/completions", json=body(PROMPTS[0]), timeout=120)
        assert response.status_code == 200 and response.headers.get("x-pd-path") == "disaggregated", response.text
        return response.json()["choices"][0]["token_ids"]

    assert net.call(head, ask) == expected
    os.kill(script.pid, signal.SIGTERM)
    assert script.wait(120) == 0, log_path.read_text()[-6000:]
    assert_nothing_of_ours_left(net)
