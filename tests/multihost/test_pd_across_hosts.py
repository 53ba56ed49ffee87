"""Prefill, decode and proxy on three separate network hosts (launch/hosts.py):
P on host 0, D on host 1, the proxy on host 2, each server's KV side channel, events and
NIXL agent on its host's address (`--kv-host`). The agents choose transports that cross
a network (UCX over TCP: no shared memory, no CMA, though the hosts share a kernel), the
servers' start-up lines say so, D's reads move the KV as bytes over TCP, and every answer
equals the colocated server's (a server on this machine's loopback, outside the hosts).
This process's own UCX choices for loopback peers, where a test set them, do not reach
the servers in the hosts (launch/hosts.py `MACHINE_ENV`)."""

from __future__ import annotations

import pytest

from launch import hosts, http_client
from launch.hosts import Network
from tests.support.pd_client import complete
from tests.support.server_harness import running_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")]
PROMPTS = ["The keeper of the lighthouse wrote down every ship that passed. ",
           "Across the bay the fishing boats came home one by one, and",
           "A short one", "Counting: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,"]


def body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_pd_across_three_hosts_answers_as_colocated(arch, tiny_models, colocated, tmp_path, monkeypatch) -> None:
    expected = [complete(colocated[arch], body(p)).token_ids for p in PROMPTS]
    monkeypatch.setenv("UCX_LOG_LEVEL", "info")  # the servers log the transports of each endpoint
    with Network(3) as net:
        p_host, d_host, proxy_host = net.hosts

        def serve(host: hosts.Host, role: str):
            return net.start(host, "serve", "--model", str(tiny_models[arch]), "--role", role, "--num-threads", "1",
                             "--kv-host", host.address, "--kv-events-host", host.address,
                             log=tmp_path / f"{role}.log", wait=False)

        p, d = serve(p_host, "prefill"), serve(d_host, "decode")
        net.ready(proxy_host, p, d)
        proxy = net.start(proxy_host, "proxy", "--prefill", p.url, "--decode", d.url, log=tmp_path / "proxy.log")

        def ask(prompt: str) -> tuple[list[int], str | None]:
            response = http_client().post(f"{proxy.url}/v1/completions", json=body(prompt), timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"], response.headers.get("x-pd-path")

        answers = [net.call(proxy_host, ask, prompt) for prompt in PROMPTS]
        assert [tokens for tokens, _ in answers] == expected
        assert {path for _, path in answers} == {"disaggregated"}
        read = net.call(proxy_host, lambda: http_client().get(f"{d.url}/metrics", timeout=10).text)
        assert float(next(line.split()[-1] for line in read.splitlines()
                          if line.startswith("pd_kv_transfer_bytes_total "))) > 0
    for role, host in (("prefill", p_host), ("decode", d_host)):
        log = (tmp_path / f"{role}.log").read_text()
        assert f"KV transfers on {host.address}: UCX transports ^sm (between hosts" in log
        peers = [line for line in log.splitlines() if "UCX  INFO" in line and "-node cfg#" in line]  # not `self`
        assert peers and all("inter-node" in line and "tcp/eth" in line and "cma" not in line
                             and "posix" not in line for line in peers), peers


def test_the_real_gemma_across_hosts_answers_as_colocated(gemma_gguf, tmp_path) -> None:
    """The real Gemma 3 270M (Q4_K_M GGUF, served from its own blocks: pd serve's
    defaults), P and D on two hosts, the proxy on a third: as a colocated server on this
    machine's loopback, and D's KV read over TCP (`pd_kv_transfer_bytes_by_path_total`)."""
    flags = ("--num-threads", "1", "--max-model-len", "1024")
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
    with running_server(gemma_gguf, tmp_path / "colocated.log", *flags) as colocated:
        expected = [complete(colocated, body(p)).token_ids for p in prompts]
    with Network(3) as net:
        p_host, d_host, proxy_host = net.hosts
        p, d = (net.start(host, "serve", "--model", str(gemma_gguf), "--role", role, "--kv-host", host.address, *flags,
                          log=tmp_path / f"{role}.log", wait=False)
                for host, role in ((p_host, "prefill"), (d_host, "decode")))
        net.ready(proxy_host, p, d)
        proxy = net.start(proxy_host, "proxy", "--prefill", p.url, "--decode", d.url, log=tmp_path / "proxy.log")

        def ask(prompt: str) -> list[int]:
            response = http_client().post(f"{proxy.url}/v1/completions", json=body(prompt), timeout=120)
            assert response.status_code == 200 and response.headers.get("x-pd-path") == "disaggregated", response.text
            return response.json()["choices"][0]["token_ids"]

        assert [net.call(proxy_host, ask, prompt) for prompt in prompts] == expected
        read = net.call(proxy_host, lambda: http_client().get(f"{d.url}/metrics", timeout=10).text)
        tcp = next(line for line in read.splitlines()
                   if line.startswith('pd_kv_transfer_bytes_by_path_total{path="tcp"}'))
        assert float(tcp.split()[-1]) > 0
