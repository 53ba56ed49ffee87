"""`python -m benchmarks.transfer_hosts` runs as written (small sizes) between two real
network hosts: its READs land P's bytes (it fails otherwise), and each row names the
transports both sides chose (every one but shared memory) and both rates."""

from __future__ import annotations

import re

import pytest

from benchmarks import transfer_hosts
from launch import hosts

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif((why := hosts.unavailable()) is not None, reason=f"no test hosts: {why}")]


def test_the_sweep_between_two_hosts_reads_the_right_bytes_over_tcp(capsys) -> None:
    rows = transfer_hosts.main(["--block-kib", "64", "256", "--read-mib", "2", "--repeats", "1"])
    assert [row["block_bytes"] for row in rows] == [64 << 10, 256 << 10]
    for row in rows:
        mine = [re.sub(r"devices (\S+),", "devices ?,", row[side]) for side in ("p", "d")]  # each its own link
        assert mine[0] == mine[1] and row["d"].startswith("UCX transports ^sm (between hosts")
        assert re.search(r"devices eth\d+,", row["d"])  # the interface of its address alone, not loopback
        assert "TCP segments 1m" in row["d"]
        assert row["nixl_gbps"] > 0 and row["tcp_gbps"] > 0 and row["nixl_over_tcp"] > 0
    assert '"nixl_over_tcp"' in capsys.readouterr().out
