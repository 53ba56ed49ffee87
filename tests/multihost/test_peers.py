"""Who can reach a server's KV across hosts (launch/hosts.py): P on host 0 names its one
peer, the decode server on host 1 (`--kv-allowed-peers`); host 2 runs another decode
server of the same deployment (same model, same secret) that is not named, and is where
the clients call from. The hosts share nothing but the bridge.

- Host 2 cannot handshake with P: its side channel refuses the address (the TCP peer's),
  so host 2 never gets P's NIXL agent metadata, which holds the keys to read P's KV
  memory. Its decode server computes the prompt itself (--kv-load-failure-policy
  recompute) and answers the same tokens; P frees the blocks at its lease.
- Every listener binds the address it was asked for: the API, the side channel and the
  NIXL agent's UCX listener the host's address, and the KV events and replay sockets
  loopback unless --kv-events-host says otherwise. Nothing listens on a wildcard.
"""

from __future__ import annotations

import socket

import pytest

from connectors.nixl.handshake import HandshakeFailed, fetch_remote_layout, handshake_request
from launch import hosts, http_client
from launch.hosts import Network
from pd.kv_transfer.signing import handshake_key, secret_from_env
from tests.support.host_listeners import listening
from tests.support.pd_client import complete, p_then_d, prefill
from tests.support.server_harness import metrics_of, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")]
LEASE_S = 4
EVENTS_PORT = 7100  # and its replay socket, 7101: every host has ports of its own
BODY = {"prompt": "The keeper of the lighthouse wrote down every ship that passed. ", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp("peers")
    with Network(3) as net:
        p_host, peer_host, stranger_host = net.hosts
        model = str(tiny_models["qwen3"])

        def serve(host: hosts.Host, name: str, role: str, *flags: str):
            return net.start(host, "serve", "--model", model, "--role", role, "--num-threads", "1",
                             "--kv-host", host.address, "--kv-lease-seconds", str(LEASE_S),
                             "--kv-events-port", str(EVENTS_PORT), *flags, log=logs / f"{name}.log", wait=False)

        p = serve(p_host, "p", "prefill", "--kv-allowed-peers", f"{peer_host.address}/32")
        peer = serve(peer_host, "peer", "decode", "--kv-events-host", peer_host.address)
        stranger = serve(stranger_host, "stranger", "decode")
        net.ready(stranger_host, p, peer, stranger)
        yield {"net": net, "hosts": net.hosts, "p": p, "peer": peer, "stranger": stranger,
               "reference": complete(colocated["qwen3"], BODY).token_ids}


def from_stranger(fleet, fn, *args):
    return fleet["net"].call(fleet["hosts"][2], fn, *args)


def metrics(fleet, server) -> dict[str, float]:
    return fleet["net"].call(fleet["hosts"][2], metrics_of, server.url)


def test_a_host_that_is_not_a_peer_cannot_handshake_nor_read_and_its_client_loses_nothing(fleet) -> None:
    p, peer, stranger = fleet["p"], fleet["peer"], fleet["stranger"]
    assert from_stranger(fleet, p_then_d, p, peer, BODY).token_ids == fleet["reference"]  # the peer reads
    assert metrics(fleet, peer)["pd_kv_transfer_reads_total"] == 1

    read_before = metrics(fleet, stranger)["pd_kv_transfer_bytes_total"]
    assert from_stranger(fleet, p_then_d, p, stranger, BODY).token_ids == fleet["reference"]  # computed itself
    after = metrics(fleet, stranger)
    assert after["pd_kv_transfer_bytes_total"] == read_before and after["pd_kv_transfer_failures_total"] == 1
    assert metrics(fleet, p)["pd_kv_transfer_handshakes_refused_total"] == 1

    compat = from_stranger(fleet, lambda: http_client().get(f"{p.url}/v1/kv_config", timeout=10).json())
    params = from_stranger(fleet, prefill, p, BODY).body["kv_transfer_params"]
    request = handshake_request("stranger", compat["compat_hash"], handshake_key(secret_from_env()))
    with pytest.raises(HandshakeFailed, match=f"{fleet['hosts'][2].address} is not an allowed peer"):
        from_stranger(fleet, fetch_remote_layout, params["remote_host"], params["remote_port"], request, 5.0)
    assert wait_until(lambda: metrics(fleet, p)["pd_kv_requests_held"] == 0, LEASE_S + 20)  # freed at its lease
    for server in (p, peer, stranger):
        assert wait_until(lambda s=server: metrics(fleet, s)["pd_kv_cache_usage"] == 0, 20), server.url
    assert from_stranger(fleet, p_then_d, p, peer, BODY).token_ids == fleet["reference"]  # still serving its peer


def test_every_listener_binds_the_address_asked_for_and_events_stay_on_loopback(fleet) -> None:
    p_host, peer_host, stranger_host = fleet["hosts"]
    for host, events_host in ((p_host, "127.0.0.1"), (peer_host, peer_host.address),
                              (stranger_host, "127.0.0.1")):
        found = listening(host)
        assert {address for address, _ in found} <= {host.address, "127.0.0.1"}, found  # no wildcard, no other
        on_loopback = {port for address, port in found if address == "127.0.0.1"}
        assert on_loopback == ({EVENTS_PORT, EVENTS_PORT + 1} if events_host == "127.0.0.1" else set()), found
        assert (host.address, hosts.PORT) in found and len(found) == 5, found  # API, side channel, UCX, events x2

    def reach(address: str, port: int) -> bool:
        try:
            socket.create_connection((address, port), timeout=5).close()
            return True
        except ConnectionRefusedError:
            return False

    for port in (EVENTS_PORT, EVENTS_PORT + 1):
        assert not from_stranger(fleet, reach, p_host.address, port)  # loopback only: not from another host
        assert from_stranger(fleet, reach, peer_host.address, port)  # --kv-events-host: as configured
