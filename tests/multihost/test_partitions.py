"""Network faults between real servers on separate hosts (launch/hosts.py): P on host 0,
two decode servers on hosts 1 and 2, the proxy on host 3 (the clients call from there).
Links are cut silently, as a partition drops packets: nobody is told, connections stay
open. In every case no token is wrong, clients get their answer or a clear error within
the configured timeouts (never a hang), the proxy routes around the cut server and takes
it back once the link returns, and KV returns to 0 everywhere.

- proxy <-> D cut mid-stream: the proxy's probes of D time out, its breaker opens, and the
  silent stream is resumed on the other D (proxy/migration.py `watched`).
- P <-> D cut before D reads: D's read stalls, fails at --kv-read-timeout, and D computes
  the prompt itself (--kv-load-failure-policy recompute); P frees the blocks at its lease.
- proxy <-> P cut during prefill: the prefill fails at --prefill-timeout and the client
  gets a clear error; P frees what it held at its lease.
- the decode servers' links capped to 10 Mbit/s: the same tokens, KV read over them.
"""

from __future__ import annotations

import json
import time

import pytest

from launch import hosts, http_client
from launch.hosts import Network
from tests.support.pd_client import complete
from tests.support.server_harness import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")]
READ_TIMEOUT_S, LEASE_S, PREFILL_TIMEOUT_S = 3, 6, 4
BODY = {"prompt": "The keeper of the lighthouse wrote down every ship that passed. ", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}
LONG = BODY | {"max_tokens": 160}


@pytest.fixture(scope="module")
def fleet(tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp("partitions")
    with Network(4) as net:
        p_host, d1_host, d2_host, proxy_host = net.hosts
        model = str(tiny_models["qwen3"])

        def serve(host: hosts.Host, name: str, role: str):
            return net.start(host, "serve", "--model", model, "--role", role, "--num-threads", "1",
                             "--kv-host", host.address, "--kv-events-host", host.address,
                             "--kv-read-timeout", str(READ_TIMEOUT_S), "--kv-lease-seconds", str(LEASE_S),
                             "--drain-timeout", "2", log=logs / f"{name}.log", wait=False)

        p, d1, d2 = serve(p_host, "p", "prefill"), serve(d1_host, "d1", "decode"), serve(d2_host, "d2", "decode")
        net.ready(proxy_host, p, d1, d2)
        proxy = net.start(proxy_host, "proxy", "--prefill", p.url, "--decode", d1.url, d2.url, "--probe-interval",
                          "1", "--breaker-failures", "2", "--breaker-cooldown", "1", "--prefill-timeout",
                          str(PREFILL_TIMEOUT_S), "--decode-timeout", "120", "--log-level", "info",
                          log=logs / "proxy.log")
        yield {"net": net, "hosts": net.hosts, "p": p, "d": [d1, d2], "proxy": proxy,
               "reference": {"short": complete(colocated["qwen3"], BODY).token_ids,
                             "long": complete(colocated["qwen3"], LONG).token_ids}}


def on_proxy_host(fleet, fn, *args):
    return fleet["net"].call(fleet["hosts"][3], fn, *args)


def ask(fleet, body: dict) -> tuple[int, dict]:
    def post():
        response = http_client().post(f"{fleet['proxy'].url}/v1/completions", json=body, timeout=180)
        return response.status_code, response.json()
    return on_proxy_host(fleet, post)


def metrics(fleet, server) -> dict[str, float]:
    def get():
        text = http_client().get(f"{server.url}/metrics", timeout=10).text
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line and not line.startswith("#")}
    return on_proxy_host(fleet, get)


def decode_state(fleet) -> dict[str, dict]:
    health = on_proxy_host(fleet, lambda: http_client().get(f"{fleet['proxy'].url}/health", timeout=10).json())
    return {i["url"]: i for i in health["decode"]}


def kv_back_to_zero(fleet) -> None:
    for server in [fleet["p"], *fleet["d"]]:
        assert wait_until(lambda s=server: metrics(fleet, s)["pd_kv_cache_usage"] == 0
                          and metrics(fleet, s).get("pd_kv_requests_held", 0) == 0, LEASE_S + 20), server.url


def test_a_decode_server_cut_from_the_proxy_mid_stream_loses_its_client_nothing(fleet) -> None:
    net, (_, d1_host, d2_host, proxy_host) = fleet["net"], fleet["hosts"]
    assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]

    def stream() -> tuple[list[int], list[dict], float, str]:
        tokens, errors, cut = [], [], None
        started = time.monotonic()
        with http_client().stream("POST", f"{fleet['proxy'].url}/v1/completions", timeout=180,
                                  json=LONG | {"stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk)
                    continue
                tokens += chunk["choices"][0]["token_ids"]
                if cut is None and len(tokens) >= 4:
                    serving = [url for url, i in decode_state(fleet).items() if i["outstanding"]]
                    cut = serving[0]
                    net.cut(proxy_host, d1_host if cut == fleet["d"][0].url else d2_host)
        return tokens, errors, time.monotonic() - started, cut

    tokens, errors, seconds, cut = on_proxy_host(fleet, stream)
    cut_host = d1_host if cut == fleet["d"][0].url else d2_host
    try:
        assert errors == [] and tokens == fleet["reference"]["long"]  # resumed on the other D
        assert seconds < 60  # detected by the probes (1 s apart, 2 failures), not the 120 s decode timeout
        assert decode_state(fleet)[cut]["breaker"] in ("open", "half_open")  # routed around (a trial at most)
        assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
    finally:
        net.restore(proxy_host, cut_host)
    assert wait_until(lambda: decode_state(fleet)[cut]["breaker"] == "closed", 20)  # taken back
    kv_back_to_zero(fleet)


def test_a_prefill_server_cut_from_the_decode_servers_has_them_compute_the_prompt(fleet) -> None:
    net, (p_host, d1_host, d2_host, _) = fleet["net"], fleet["hosts"]
    for _ in range(2):  # each decode server has read from P (handshaken) before the cut
        assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
    failed = sum(metrics(fleet, d)["pd_kv_transfer_failures_total"] for d in fleet["d"])
    net.cut(p_host, d1_host)
    net.cut(p_host, d2_host)
    try:
        started = time.monotonic()
        status, answer = ask(fleet, BODY)
        assert status == 200 and answer["choices"][0]["token_ids"] == fleet["reference"]["short"]
        assert READ_TIMEOUT_S <= time.monotonic() - started < READ_TIMEOUT_S + 30
        assert sum(metrics(fleet, d)["pd_kv_transfer_failures_total"] for d in fleet["d"]) == failed + 1
    finally:
        net.restore(p_host, d1_host)
        net.restore(p_host, d2_host)
    kv_back_to_zero(fleet)  # P frees the unread blocks at its lease
    assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]


def test_a_prefill_server_cut_from_the_proxy_gives_a_clear_error_in_time(fleet) -> None:
    net, (p_host, _, _, proxy_host) = fleet["net"], fleet["hosts"]
    net.cut(proxy_host, p_host)
    try:
        started = time.monotonic()
        status, answer = ask(fleet, BODY)
        assert time.monotonic() - started < PREFILL_TIMEOUT_S * 3 + 10  # its timeout (and its retries), no hang
        assert status in (502, 503, 504) and answer["error"]["message"], answer
    finally:
        net.restore(proxy_host, p_host)
    assert wait_until(lambda: ask(fleet, BODY)[0] == 200, 30)  # taken back once the link returns
    assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
    kv_back_to_zero(fleet)


def test_a_decode_server_on_a_10_mbit_link_answers_as_colocated(fleet) -> None:
    """Its KV reads and its streams cross a link shaped to 10 Mbit/s each way: slower, the
    same tokens."""
    net, (_, d1_host, d2_host, _) = fleet["net"], fleet["hosts"]
    read = sum(metrics(fleet, d)["pd_kv_transfer_bytes_total"] for d in fleet["d"])
    for host in (d1_host, d2_host):
        net.cap(host, 10)
    try:
        for _ in range(2):  # one on each decode server (least loaded, one at a time)
            status, answer = ask(fleet, BODY)
            assert status == 200 and answer["choices"][0]["token_ids"] == fleet["reference"]["short"]
        assert sum(metrics(fleet, d)["pd_kv_transfer_bytes_total"] for d in fleet["d"]) > read
    finally:
        for host in (d1_host, d2_host):
            net.uncap(host)
    kv_back_to_zero(fleet)
