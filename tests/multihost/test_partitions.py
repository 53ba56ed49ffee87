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
- P <-> D cut during a read (P's link capped so that the read of a long prompt's KV
  lasts seconds; cut once P's socket to D holds the data in flight): the same.
- proxy <-> P cut during prefill: the prefill fails at --prefill-timeout and the client
  gets a clear error; P frees what it held at its lease.
- the decode servers' links capped to 10 Mbit/s: the same tokens, KV read over them.
- a decode server's link flapping (down 2 s, up 2 s) under streams: every stream whole and
  right; the server taken back once the link holds.

Each test prints what it measured (`pytest -s`): when the fault was detected, routed
around, and recovered from (the README's fault table).
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest

from launch import hosts, http_client
from launch.hosts import Network
from tests.support.pd_client import complete
from tests.support.server_harness import metrics_of, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")]
READ_TIMEOUT_S, LEASE_S, PREFILL_TIMEOUT_S = 3, 6, 4
FLAPPING_S = 10  # streams come while the link flaps: two and a half of its cycles
BODY = {"prompt": "The keeper of the lighthouse wrote down every ship that passed. ", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}
LONG = BODY | {"max_tokens": 600}  # ~1 s on one D: a cut after its 4th token lands mid-stream
LONG_PROMPT = BODY | {"prompt": "The keeper counted the ships again and wrote each name down. " * 70}  # ~1.9k tokens


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
                             "long": complete(colocated["qwen3"], LONG).token_ids,
                             "long_prompt": complete(colocated["qwen3"], LONG_PROMPT).token_ids}}


def on_proxy_host(fleet, fn, *args):
    return fleet["net"].call(fleet["hosts"][3], fn, *args)


def ask(fleet, body: dict) -> tuple[int, dict]:
    def post():
        response = http_client().post(f"{fleet['proxy'].url}/v1/completions", json=body, timeout=180)
        return response.status_code, response.json()
    return on_proxy_host(fleet, post)


def metrics(fleet, server) -> dict[str, float]:
    return fleet["net"].call(fleet["hosts"][3], metrics_of, server.url)


def decode_state(fleet) -> dict[str, dict]:
    health = on_proxy_host(fleet, lambda: http_client().get(f"{fleet['proxy'].url}/health", timeout=10).json())
    return {i["url"]: i for i in health["decode"]}


def kv_back_to_zero(fleet) -> None:
    for server in [fleet["p"], *fleet["d"]]:
        assert wait_until(lambda s=server: metrics(fleet, s)["pd_kv_cache_usage"] == 0
                          and metrics(fleet, s).get("pd_kv_requests_held", 0) == 0, LEASE_S + 20), server.url


def stream(fleet, body: dict, after_4_tokens=None) -> tuple[list[int], list[dict], list[float]]:
    """Stream `body` through the proxy (from its host): the tokens, the error events, and
    when each chunk came; `after_4_tokens()` is called once 4 tokens have come."""
    tokens, errors, times, pending = [], [], [], [after_4_tokens]

    def read():
        with http_client().stream("POST", f"{fleet['proxy'].url}/v1/completions", timeout=180,
                                  json=body | {"stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                times.append(time.monotonic())
                if "error" in chunk:
                    errors.append(chunk)
                    continue
                tokens.extend(chunk["choices"][0]["token_ids"])
                if pending[0] is not None and len(tokens) >= 4:
                    pending.pop()()
                    pending.append(None)
    on_proxy_host(fleet, read)
    return tokens, errors, times


def report(fault: str, **seconds: float) -> None:
    print(f"\n{fault}: " + ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items()))


def test_a_decode_server_cut_from_the_proxy_mid_stream_loses_its_client_nothing(fleet) -> None:
    net, (_, d1_host, d2_host, proxy_host) = fleet["net"], fleet["hosts"]
    assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
    cut: dict = {}

    def cut_the_serving_one() -> None:
        cut["url"] = next(url for url, i in decode_state(fleet).items() if i["outstanding"])
        cut["host"] = d1_host if cut["url"] == fleet["d"][0].url else d2_host
        cut["at"] = time.monotonic()
        net.cut(proxy_host, cut["host"])
        threading.Thread(target=watch_the_breaker, daemon=True).start()

    def watch_the_breaker() -> None:  # from this test's thread: the proxy host's is streaming
        while "opened" not in cut and time.monotonic() < cut["at"] + 60:
            state = fleet["net"].call(proxy_host, lambda: http_client().get(f"{fleet['proxy'].url}/health",
                                                                             timeout=10).json())
            if any(i["url"] == cut["url"] and i["breaker"] != "closed" for i in state["decode"]):
                cut["opened"] = time.monotonic()
            time.sleep(0.05)

    tokens, errors, times = stream(fleet, LONG, cut_the_serving_one)
    try:
        assert errors == [] and tokens == fleet["reference"]["long"]  # resumed on the other D
        assert times[-1] - cut["at"] < 60  # detected by the probes (1 s apart, 2 failures), not the decode timeout
        assert wait_until(lambda: decode_state(fleet)[cut["url"]]["breaker"] in ("open", "half_open"), 20)  # around
        assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
    finally:
        restored = time.monotonic()
        net.restore(proxy_host, cut["host"])
    assert wait_until(lambda: decode_state(fleet)[cut["url"]]["breaker"] == "closed", 20)  # taken back
    back = time.monotonic()
    resumed = next(t for t in times if t > cut["at"] + 0.5)  # the first chunk after the stall
    report("proxy <-> D cut mid-stream", detected=cut.get("opened", float("nan")) - cut["at"],
           routed_around=resumed - cut["at"], taken_back=back - restored)
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


def in_flight_to(host: hosts.Host, peers: list[hosts.Host]) -> str | None:
    """A peer of `peers` that `host` has more than 64 KiB queued to send to (a read under
    way over a slow link), or None."""
    out = subprocess.run(["ip", "netns", "exec", host.name, "ss", "-Htn"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    for line in out.splitlines():  # state, recv-q, send-q, local, peer
        fields = line.split()
        if len(fields) >= 5 and int(fields[2]) > 64 << 10:
            peer = re.sub(r":\d+$", "", fields[4]).strip("[]")
            if peer in [p.address for p in peers]:
                return peer
    return None


def test_a_prefill_server_cut_from_the_decode_servers_during_a_read_has_them_compute_the_prompt(fleet) -> None:
    net, (p_host, d1_host, d2_host, _) = fleet["net"], fleet["hosts"]
    for _ in range(2):  # each decode server has read from P (handshaken) before
        assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
    failed = sum(metrics(fleet, d)["pd_kv_transfer_failures_total"] for d in fleet["d"])
    reads = sum(metrics(fleet, d)["pd_kv_transfer_reads_total"] for d in fleet["d"])
    net.cap(p_host, 10)  # the long prompt's ~8 MB of KV take ~7 s to cross
    answer: dict = {}
    asking = threading.Thread(target=lambda: answer.update(zip(("status", "body"), ask(fleet, LONG_PROMPT))))
    try:
        asking.start()
        assert wait_until(lambda: in_flight_to(p_host, [d1_host, d2_host]) is not None, 30)
        cut_at = time.monotonic()
        net.cut(p_host, d1_host)
        net.cut(p_host, d2_host)
        asking.join(READ_TIMEOUT_S + 60)
        answered = time.monotonic()
        assert not asking.is_alive()
        assert answer["status"] == 200
        assert answer["body"]["choices"][0]["token_ids"] == fleet["reference"]["long_prompt"]
        assert answered - cut_at < READ_TIMEOUT_S + 30
    finally:
        net.restore(p_host, d1_host)
        net.restore(p_host, d2_host)
        net.uncap(p_host)
    restored = time.monotonic()
    assert sum(metrics(fleet, d)["pd_kv_transfer_failures_total"] for d in fleet["d"]) == failed + 1
    assert sum(metrics(fleet, d)["pd_kv_transfer_reads_total"] for d in fleet["d"]) == reads  # none completed
    kv_back_to_zero(fleet)  # P frees the blocks it held at its lease

    def read_again() -> bool:  # a request whose KV is read from P, not computed: KV moves again
        before = sum(metrics(fleet, d)["pd_kv_transfer_reads_total"] for d in fleet["d"])
        assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
        return sum(metrics(fleet, d)["pd_kv_transfer_reads_total"] for d in fleet["d"]) > before

    assert wait_until(read_again, 60)
    report("P <-> D cut during a read", answered=answered - cut_at, reads_again=time.monotonic() - restored)


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


def test_a_decode_server_on_a_flapping_link_loses_no_stream(fleet) -> None:
    """D1's link down 2 s, up 2 s, while streams come through the proxy: each is whole and
    right (stalled, or resumed on D2); once the link holds, D1 is taken back."""
    net, (_, d1_host, _, _) = fleet["net"], fleet["hosts"]
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            net.cut(d1_host)
            stop.wait(2)
            net.restore(d1_host)
            stop.wait(2)

    flapping = threading.Thread(target=flap)
    flapping.start()
    longest, shortest = 0.0, float("inf")
    try:
        started = time.monotonic()
        while time.monotonic() < started + FLAPPING_S:
            began = time.monotonic()
            tokens, errors, _ = stream(fleet, LONG)
            assert errors == [] and tokens == fleet["reference"]["long"]
            longest, shortest = max(longest, time.monotonic() - began), min(shortest, time.monotonic() - began)
    finally:
        stop.set()
        flapping.join()
        net.restore(d1_host)
    held = time.monotonic()
    assert wait_until(lambda: decode_state(fleet)[fleet["d"][0].url]["breaker"] == "closed", 30)
    report("D's link flapping every 2 s", longest_stream=longest, shortest_stream=shortest,
           taken_back=time.monotonic() - held)
    kv_back_to_zero(fleet)
    assert ask(fleet, BODY)[1]["choices"][0]["token_ids"] == fleet["reference"]["short"]
