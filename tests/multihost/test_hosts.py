"""The test hosts themselves (launch/hosts.py): hosts reach each other on the
bridge's addresses alone; a cut drops traffic silently between two hosts (both ways, or
one) or on a host's whole link while the others still talk, and is undone; a cap shapes
a link; closing leaves no namespace, and the machine's own network is never touched.
Skipped, saying why, where namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from launch import hosts
from launch.hosts import Network

pytestmark = pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")
PORT = 9000
LISTEN = f"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], {PORT})); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 16): pass
    c.close()
"""
CONNECT = f"""
import socket, sys, time
s = socket.socket(); s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], {PORT}))
    start = time.monotonic(); s.sendall(b"x" * int(sys.argv[2])); s.shutdown(socket.SHUT_WR); s.recv(1)
    print("sent", time.monotonic() - start)
except OSError as e:
    print("failed", type(e).__name__)
"""
UDP_LISTEN = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 9001)); s.settimeout(float(sys.argv[2]))
print("listening", flush=True)
try:
    print("got", s.recv(100).decode())
except OSError:
    print("nothing")
"""


def listen(net: Network, host: hosts.Host) -> subprocess.Popen:
    process = net.popen(host, [sys.executable, "-c", LISTEN, host.address], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "listening"
    return process


def send(net: Network, src: hosts.Host, dst: hosts.Host, size: int = 1000, timeout: float = 1.0) -> str:
    """What a TCP client in `src` made of sending `size` bytes to `dst`'s listener."""
    process = net.popen(src, [sys.executable, "-c", CONNECT, dst.address, str(size), str(timeout)],
                        stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=timeout + 60)
    return out.strip()


def udp(net: Network, src: hosts.Host, dst: hosts.Host) -> str:
    """Whether one datagram from `src` reaches `dst`."""
    receiver = net.popen(dst, [sys.executable, "-c", UDP_LISTEN, dst.address, "1.0"], stdout=subprocess.PIPE,
                         text=True)
    assert receiver.stdout.readline().strip() == "listening"
    net.popen(src, [sys.executable, "-c", f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                                          f".sendto(b'hi', ('{dst.address}', 9001))"]).wait(30)
    return receiver.communicate(timeout=30)[0].strip()


def own_links() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def net():
    with Network(3) as network:
        for host in network.hosts:
            listen(network, host)
        yield network


def test_hosts_reach_each_other_on_the_bridge_and_nothing_else(net) -> None:
    a, b, c = net.hosts
    assert [h.address for h in net.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert send(net, a, b).startswith("sent") and send(net, c, a).startswith("sent")
    routes = subprocess.run(["ip", "-n", a.name, "route"], capture_output=True, text=True, check=True).stdout
    assert routes.strip() == f"198.18.0.0/24 dev {a.device} proto kernel scope link src {a.address}"  # no way out


def test_a_cut_between_two_hosts_drops_their_traffic_silently_and_no_one_elses(net) -> None:
    a, b, c = net.hosts
    net.cut(a, b)
    try:
        assert send(net, a, b) == "failed TimeoutError"  # silence, not a refusal
        assert send(net, b, a) == "failed TimeoutError"
        assert send(net, a, c).startswith("sent") and send(net, c, b).startswith("sent")
    finally:
        net.restore(a, b)
    assert send(net, a, b, timeout=5).startswith("sent")


def test_a_one_way_cut_drops_only_what_one_host_sends(net) -> None:
    a, b, _ = net.hosts
    net.cut(a, b, one_way=True)
    try:
        assert udp(net, a, b) == "nothing"
        assert udp(net, b, a) == "got hi"
    finally:
        net.restore(a, b)
    assert udp(net, a, b) == "got hi"


def test_a_cut_link_isolates_its_host_both_ways_or_one(net) -> None:
    a, b, c = net.hosts
    net.cut(a)
    try:
        assert send(net, a, b) == "failed TimeoutError" and send(net, c, a) == "failed TimeoutError"
        assert send(net, b, c).startswith("sent")
    finally:
        net.restore(a)
    net.cut(a, one_way=True)
    try:
        assert udp(net, a, b) == "nothing" and udp(net, b, a) == "got hi"
    finally:
        net.restore(a)
    assert send(net, a, b, timeout=5).startswith("sent")


def test_a_capped_link_is_shaped_to_its_rate(net) -> None:
    """A wide bound, not a measurement: 2 MB at 10 Mbit/s take 1.6 s; uncapped, a blink."""
    a, b, _ = net.hosts
    size = 2_000_000
    net.cap(a, 10)
    try:
        capped = float(send(net, a, b, size, timeout=30).split()[1])
    finally:
        net.uncap(a)
    uncapped = float(send(net, a, b, size, timeout=30).split()[1])
    assert capped > 1.0 and uncapped < capped / 4, (capped, uncapped)


def test_closing_leaves_nothing_and_a_dead_runs_hosts_are_swept() -> None:
    before_links, before = own_links(), namespaces()
    with Network(2) as net:
        made = {h.name for h in net.hosts} | {net.switch}
        assert made <= namespaces()
        listen(net, net[0])
        assert own_links() == before_links  # the machine's own namespace is untouched
    assert not made & namespaces() and own_links() == before_links
    dead = 2**22 + 1  # beyond any PID this machine hands out (pid_max is at most 2**22)
    assert not os.path.exists(f"/proc/{dead}")
    subprocess.run(["ip", "netns", "add", f"{hosts.PREFIX}{dead}x0"], check=True)
    assert hosts.sweep() == [f"{hosts.PREFIX}{dead}x0"]
    assert namespaces() == before
    started = time.monotonic()
    Network(1).close()
    assert time.monotonic() - started < 30
