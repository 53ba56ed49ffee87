"""This host's network interfaces, as the calling thread's network namespace has them:
which interface holds an address (UCX listens there alone, and gloo's collectives go
there: connectors/nixl/ucx.py, pd/worker/tp_ranks.py), the RDMA ports, and the address
this host reaches another from."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this host (the calling thread's
    network namespace), or None."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.version == 6:
        with open("/proc/net/if_inet6") as table:  # address (32 hex digits), index, prefix, scope, flags, name
            return next((fields[5] for fields in map(str.split, table)
                         if ipaddress.IPv6Address(int(fields[0], 16)) == wanted), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                ifreq = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if ipaddress.ip_address(ifreq[20:24]) == wanted:
                return name
    return None


def rdma_ports(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """This host's RDMA ports as UCX names them (`mlx5_0:1`)."""
    return sorted(f"{device.name}:{port.name}" for device in root.glob("*") for port in (device / "ports").glob("*"))


def source_address(peer: str) -> str:
    """The address of this host that its routes send packets for `peer` from (no packet
    is sent: a UDP socket connected, then read)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]
