"""What listens in a test host (launch/hosts.py), as `ss` inside its namespace says."""

from __future__ import annotations

import subprocess

from launch.hosts import Host


def listening(host: Host, pid: int | None = None) -> set[tuple[str, int]]:
    """The TCP listeners in `host` (of process `pid` alone, if given): (address, port)."""
    out = subprocess.run(["ip", "netns", "exec", host.name, "ss", "-Hltnp"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    found = set()
    for line in out.splitlines():
        if pid is None or f"pid={pid}," in line:
            address, _, port = line.split()[3].rpartition(":")
            found.add((address.strip("[]"), int(port)))
    return found
