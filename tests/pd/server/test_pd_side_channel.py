"""The NIXL connector's side channel and layouts on live servers: malformed and
incompatible handshakes are refused while the servers keep serving, an incompatible
P/D pair never produces wrong output, and the canonical layout moves a request with
fewer transfer descriptors than the per-layer layout.

Servers per architecture: `p` and `d` (canonical layout), `p_pl` and `d_pl` (per-layer
layout), all with the NIXL connector and a 10 s lease, and `c` colocated."""

from __future__ import annotations

import contextlib
import json
import os
import time

import msgspec
import pytest
import zmq

from connectors.nixl.handshake import HandshakeFailed, fetch_remote_layout, handshake_request
from connectors.nixl.peer_messages import HandshakeRequest, HandshakeResponse, decode_reply
from launch import http_client
from pd.kv_transfer.signing import handshake_key, secret_from_env
from tests.support.pd_client import complete, p_then_d, prefill
from tests.support.server_harness import running_server, started_together

pytestmark = pytest.mark.slow
LEASE_S = 10
BODY = {"prompt": "The side channel carries agent metadata and block layouts between servers. " * 6,
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen3", "bamba"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def servers(arch, tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"side-channel-{arch}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    nixl = ("--kv-connector", "nixl", "--kv-lease-seconds", str(LEASE_S))
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models[arch], logs / f"{name}.log", *args, wait=False))
        servers = {"p": start("p", *nixl), "d": start("d", *nixl),
                   "p_pl": start("p_pl", *nixl, "--kv-layout", "per-layer"),
                   "d_pl": start("d_pl", *nixl, "--kv-layout", "per-layer")}
        reference = colocated[arch]
        started_together(stack, *servers.values())
        yield servers | {"c": reference}


def ask(port: int, frames: list[bytes]) -> bytes:
    """Send raw frames to a side channel; its raw reply."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://127.0.0.1:{port}")
        socket.send_multipart([b"", *frames])
        assert socket.poll(5000, zmq.POLLIN), "no reply from the side channel"
        return socket.recv_multipart()[-1]
    finally:
        socket.close()
        context.term()


def test_malformed_and_incompatible_handshakes_are_refused_and_p_keeps_serving(servers) -> None:
    p, d, c = servers["p"], servers["d"], servers["c"]
    params = prefill(p, BODY).body["kv_transfer_params"]  # D reads it after the abuse below
    port = params["remote_port"]
    abuse = {
        "garbage": [b"\x00\xffnot msgpack at all"],
        "wrong schema": [msgspec.msgpack.encode({"type": "handshake_request", "engine_id": 7})],
        "wrong message": [msgspec.msgpack.encode({"type": "read_done", "request_id": "x"})],
        "two frames": [b"a", b"b"],
        "oversized": [b"\x00" * (2 << 20)],
    }
    for name, frames in abuse.items():
        reply = decode_reply(ask(port, frames))
        assert not isinstance(reply, HandshakeResponse) and reply.reason, name
    key = handshake_key(secret_from_env())
    with pytest.raises(HandshakeFailed, match="incompatible KV layout"):
        fetch_remote_layout("127.0.0.1", port, handshake_request("intruder", "0" * 64, key), 5)
    compat = http_client().get(f"{p.url}/v1/kv_config", timeout=10).json()["compat_hash"]
    for unproved in (HandshakeRequest("intruder", compat),  # no proof of the deployment's secret
                     handshake_request("intruder", compat, secret_from_env()),  # the secret is not the key
                     handshake_request("intruder", compat, key, lambda: time.time() - 3600)):
        with pytest.raises(HandshakeFailed, match="prove the deployment's transfer secret|proof was made more"):
            fetch_remote_layout("127.0.0.1", port, unproved, timeout_s=5)
    assert p.health().status_code == 200 and p.metrics()["pd_kv_requests_held"] == 1
    got = complete(d, BODY | {"kv_transfer_params": params})  # a real handshake and read still work
    assert got.token_ids == complete(c, BODY).token_ids
    assert d.metrics()["pd_kv_transfer_failures_total"] == 0
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0


def test_an_incompatible_pair_fails_at_handshake_and_d_recomputes_the_right_tokens(servers) -> None:
    """Canonical P, per-layer D: the compat hashes differ, so D never reads P's bytes."""
    p, d_pl, c = servers["p"], servers["d_pl"], servers["c"]
    before = d_pl.metrics()
    got = p_then_d(p, d_pl, BODY)
    assert got.token_ids == complete(c, BODY).token_ids
    after = d_pl.metrics()
    assert after["pd_kv_transfer_failures_total"] - before["pd_kv_transfer_failures_total"] == 1
    assert after["pd_kv_transfer_reads_total"] == before["pd_kv_transfer_reads_total"]
    assert "incompatible KV layout" in d_pl.log_tail(20000)
    # D could not reach P's agent to reject, so P frees the blocks when the lease ends
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0, timeout=LEASE_S + 10) == 0
    assert p.metrics()["pd_kv_cache_usage"] == 0


def test_the_canonical_layout_moves_a_request_with_fewer_descriptors(servers, tiny_models, arch) -> None:
    c = servers["c"]
    expected = complete(c, BODY).token_ids
    descriptors, read_bytes = {}, {}
    for layout, (p, d) in {"canonical": (servers["p"], servers["d"]),
                           "per-layer": (servers["p_pl"], servers["d_pl"])}.items():
        before = d.metrics()
        assert p_then_d(p, d, BODY).token_ids == expected
        after = d.metrics()
        assert after["pd_kv_transfer_reads_total"] - before["pd_kv_transfer_reads_total"] == 1, layout
        descriptors[layout] = after["pd_kv_transfer_descriptors_total"] - before["pd_kv_transfer_descriptors_total"]
        read_bytes[layout] = after["pd_kv_transfer_bytes_total"] - before["pd_kv_transfer_bytes_total"]
    assert read_bytes["canonical"] == read_bytes["per-layer"] > 0  # the same data
    assert 0 < descriptors["canonical"] < descriptors["per-layer"], descriptors
    if arch == "qwen3":  # one group, one run of blocks: 1 descriptor, against one per layer
        num_layers = json.loads((tiny_models[arch] / "config.json").read_text())["num_hidden_layers"]
        assert descriptors == {"canonical": 1, "per-layer": num_layers}
