"""`pd planner` against a live fleet: three `--role both` servers registered with a proxy,
load that the split now serves worse than another, and the planner moves one server
(after its patience), says why on the proxy (its decisions, the fleet's changes, the
metric), and moves nothing more once the split is the best; nothing fails meanwhile.

With `--launcher local` the planner starts its fleet itself (the servers join the proxy by
registering), stops a server it no longer needs (drained through the proxy first, then
SIGTERM: it leaves the fleet and exits), never goes below `--min-instances`, adds a
server under a load its fleet cannot serve (up to `--max-instances`), and stops every
server it started when it is stopped."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from launch import health_status, http_client, pd_command, running
from tests.support.server_harness import TEST_DRAIN_S, running_proxy, running_server, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
KEY = "planner-test-key"
LONG_PROMPT = {"prompt": "The keeper of the lighthouse wrote down every ship that passed the cape. " * 12,
               "max_tokens": 2, "temperature": 0, "ignore_eos": True}
LONG_ANSWER = {"prompt": "Ships:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def fleet_state(front) -> dict:
    response = http_client().get(f"{front.url}/admin/instances", headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=10)
    return response.json()


def roles(front) -> list[str]:
    return sorted(i["role"] for i in fleet_state(front)["instances"])


def serving_roles(front) -> list[str]:
    """The roles of the instances taking requests (not draining)."""
    return sorted(i["role"] for i in fleet_state(front)["instances"] if not i["draining"])


@contextlib.contextmanager
def load(front, body: dict, clients: int = 6):
    """`clients` clients sending `body` through the proxy in a loop; their statuses."""
    stop, statuses = threading.Event(), []

    def client() -> None:
        while not stop.is_set():
            statuses.append(http_client().post(f"{front.url}/v1/completions", json=body, timeout=60).status_code)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def planner(front, tmp_path, name: str, *slo: str):
    return running(pd_command("planner", "--proxy", front.url, "--admin-key", KEY, *slo, "--interval", "0.5",
                              "--patience", "2", "--cooldown", "30"),
                   front.url, tmp_path / f"{name}.log", ready=lambda status: True)


def test_the_planner_moves_a_server_to_the_role_the_load_needs_and_stops_there(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", KEY))
        joining = ("--register", front.url, "--role", "both", "--kv-connector", "nixl")
        for name, role in (("a", "prefill"), ("b", "decode"), ("c", "decode")):
            stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / f"{name}.log", *joining,
                                               "--register-role", role))
        assert wait_until(lambda: roles(front) == ["decode", "decode", "prefill"], 30)

        # Long prompts, two tokens each, and a TTFT target no split meets: the prefill pool
        # is what to grow (TPOT's target is loose).
        with load(front, LONG_PROMPT) as statuses, planner(front, tmp_path, "planner-ttft", "--ttft-slo", "0.001",
                                                           "--tpot-slo", "10"):
            assert wait_until(lambda: roles(front) == ["decode", "prefill", "prefill"] and any(
                d["action"] == "switch" for d in fleet_state(front)["decisions"]), 60), fleet_state(front)
            moved = fleet_state(front)
            switch = next(d for d in moved["decisions"] if d["action"] == "switch")
            assert switch["role"] == "prefill" and "1P2D" in switch["reason"] and "2P1D" in switch["reason"]
            assert switch["inputs"]["load"]["arrival_rate"] > 0 and "splits" in switch["inputs"]
            assert any(c["action"] == "role" and c["reason"].startswith("planner:") for c in moved["changes"])
            holds = sum(d["action"] == "hold" for d in moved["decisions"])
            assert holds >= 1  # it waited for its patience first
            threading.Event().wait(3)  # six more ticks
            assert roles(front) == ["decode", "prefill", "prefill"]  # one decode server is left, always
        assert set(statuses) == {200}, statuses

        # Long answers and a TPOT target no split meets: the decode pool is what to grow.
        with load(front, LONG_ANSWER) as statuses, planner(front, tmp_path, "planner-tpot", "--ttft-slo", "100",
                                                           "--tpot-slo", "0.00001"):
            assert wait_until(lambda: roles(front) == ["decode", "decode", "prefill"] and sum(
                d["action"] == "switch" for d in fleet_state(front)["decisions"]) == 2, 60), fleet_state(front)
        assert set(statuses) == {200}, statuses
        metrics = http_client().get(f"{front.url}/metrics", timeout=5).text
        assert 'pd_proxy_planner_decisions_total{action="switch"} 2.0' in metrics
        assert 'pd_proxy_fleet_changes_total{action="role"} 2.0' in metrics


def test_the_planner_starts_its_fleet_stops_what_it_does_not_need_and_everything_at_its_end(tiny_models,
                                                                                          tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", KEY))
        # No traffic: 2P1D meets the SLO with room to spare, and so would 1P1D; 1P0D or 0P1D
        # would not be a fleet, and --min-instances 2 keeps two.
        planner = stack.enter_context(running(pd_command(
            "planner", "--proxy", front.url, "--admin-key", KEY, "--ttft-slo", "5", "--tpot-slo", "1",
            "--interval", "0.5", "--patience", "2", "--cooldown", "1", "--launcher", "local",
            "--model", str(tiny_models["qwen3"]), "--serve-args", f"--num-threads 1 --drain-timeout {TEST_DRAIN_S}",
            "--start-prefill", "2", "--start-decode", "1", "--min-instances", "2", "--max-instances", "3",
            "--scale-down-after", "1",
            "--log-dir", str(tmp_path / "servers")), front.url, tmp_path / "planner.log", ready=lambda status: True))
        assert wait_until(lambda: len(fleet_state(front)["instances"]) == 3, 120), fleet_state(front)
        started = [i["url"] for i in fleet_state(front)["instances"]]

        assert wait_until(lambda: serving_roles(front) == ["decode", "prefill"]
                          and len(fleet_state(front)["instances"]) == 2, 60), fleet_state(front)
        state = fleet_state(front)
        (remove,) = [d for d in state["decisions"] if d["action"] == "remove"]
        assert remove["role"] == "prefill" and "2P1D" in remove["reason"] and "1P1D" in remove["reason"]
        (gone,) = set(started) - {i["url"] for i in state["instances"]}
        assert gone == remove["url"]
        actions = [(c["url"], c["action"]) for c in reversed(state["changes"])]  # newest first, listed
        assert actions.index((gone, "drained")) < actions.index((gone, "removed")), actions  # drained, then removed
        assert wait_until(lambda: health_status(gone) is None, 30), "the removed server still answers"

        response = http_client().post(f"{front.url}/v1/completions", timeout=60,
                                      json={"prompt": "The fleet", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        assert not wait_until(lambda: len(fleet_state(front)["instances"]) < 2, 3)  # six ticks: at its minimum

        kept = [i["url"] for i in fleet_state(front)["instances"]]
        planner_process = planner.process
        planner_process.terminate()
        assert planner_process.wait(timeout=60) == 0, (tmp_path / "planner.log").read_text()[-4000:]
        assert wait_until(lambda: fleet_state(front)["instances"] == [], 30), fleet_state(front)
        assert all(health_status(url) is None for url in kept), "a server the planner started still runs"
        assert "stopping the 2 server(s) the launcher started" in (tmp_path / "planner.log").read_text()


def test_under_a_load_no_split_serves_the_planner_adds_a_server_of_the_role_it_lacks_up_to_its_maximum(
        tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", KEY))
        stack.enter_context(running(pd_command(
            "planner", "--proxy", front.url, "--admin-key", KEY, "--ttft-slo", "0.001", "--tpot-slo", "10",
            "--interval", "0.5", "--patience", "2", "--cooldown", "1", "--launcher", "local",
            "--model", str(tiny_models["qwen3"]), "--serve-args", f"--num-threads 1 --drain-timeout {TEST_DRAIN_S}",
            "--start-prefill", "1", "--start-decode", "1", "--max-instances", "3",
            "--log-dir", str(tmp_path / "servers")), front.url, tmp_path / "planner.log", ready=lambda status: True))
        assert wait_until(lambda: len(fleet_state(front)["instances"]) == 2, 120), fleet_state(front)
        # Long prompts and a TTFT target no split meets: the prefill pool is what to grow, and
        # with no server to switch (1P1D), a server is added.
        with load(front, LONG_PROMPT, clients=4) as statuses:
            assert wait_until(lambda: serving_roles(front) == ["decode", "prefill", "prefill"], 90), fleet_state(front)
            adds = [d for d in fleet_state(front)["decisions"] if d["action"] == "add"]
            assert adds and adds[-1]["role"] == "prefill" and "1P1D" in adds[-1]["reason"]
            assert not wait_until(lambda: len(fleet_state(front)["instances"]) > 3, 3)  # its maximum
        assert set(statuses) == {200}, statuses
