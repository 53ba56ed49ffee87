"""Every socket a server listens on is on the address it was told (`--host`, `--kv-host`):
the HTTP port, the KV side channel and UCX's own listeners, read from /proc."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path

import pytest

from launch import http_client
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow
LISTEN = "0A"  # TCP state in /proc/net/tcp*


def listening_addresses(pids: set[int]) -> list[str]:
    """The local addresses of the TCP sockets in LISTEN state that these processes hold."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                found.append(_address(local))
    return found


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def test_a_pd_pair_listens_on_loopback_only(tiny_models, tmp_path) -> None:
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "p.log", "--role", "prefill"))
        d = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "d.log", "--role", "decode"))
        body = {"prompt": "The keeper counted ships. " * 4, "max_tokens": 3}
        params = http_client().post(f"{p.url}/v1/completions", timeout=60, json=body | {
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        assert http_client().post(f"{d.url}/v1/completions", json=body | {"kv_transfer_params": params},
                                  timeout=60).status_code == 200
        assert d.metrics()["pd_kv_transfer_reads_total"] == 1  # the transfer ran over loopback
        for server in (p, d):
            pids = {server.process.pid} | children(server.process.pid)
            addresses = listening_addresses(pids)
            assert len(addresses) >= 3, addresses  # HTTP, side channel, UCX
            assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
