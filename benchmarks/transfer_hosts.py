"""`python -m benchmarks.transfer_hosts` (root): KV transfer speed between two network
hosts (network namespaces on a bridge, launch/hosts.py), NIXL READ against a plain TCP
stream between the same two hosts.

P runs in host A and D in host B, each a process of its own with the transports a server
on a non-loopback `--kv-host` chooses (connectors/nixl/ucx.py: every UCX transport but
shared memory, so TCP here). For each block size, one READ of `--read-mib` of blocks
scattered in both caches (every other block, reversed on D: one descriptor a block), as
`benchmarks/transfer.py`'s sweep reads; against it, the same bytes sent over one TCP
connection from A to B (`sendall` of a buffer, `recv_into` one). The two are timed in
turns, each first in every other round; "nixl_over_tcp" is the median of the rounds'
TCP time / NIXL time (1.0: as fast as the stream). P polls its agent every
`--peer-poll-ms`, as a prefill server's engine step does.

    python -m benchmarks.transfer_hosts --block-kib 64 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from benchmarks.transfer_peer import P_SEED, timed_read
from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout
from connectors.nixl.peer_messages import HandshakeRequest, HandshakeResponse
from connectors.nixl.ucx import configure_ucx, describe
from launch.hosts import Network, unavailable

LENGTH = 8  # bytes of the length a TCP round asks for


def _caches(tensor: torch.Tensor):
    from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor

    return CanonicalKVCaches([KVCacheBlockTensor(tensor)], [[KVCacheBlockDataRef(0, tensor.shape[1])]])


def serve_p(address: str, num_blocks: int, block_bytes: int, poll_s: float) -> None:
    """P in host A (`--serve-p`): the blocks, the side channel and a TCP sender of the same
    buffer; prints what D needs as one JSON line, then serves until stopped."""
    from connectors.nixl.transport import NixlTransport

    configure_ucx(address)
    buffer = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8,
                           generator=torch.Generator().manual_seed(P_SEED))
    transport = NixlTransport("P-hosts", _caches(buffer))
    side = SideChannelServer(address, 0, lambda request: HandshakeResponse(
        transport.agent_metadata(), transport.local_layout("hosts")))
    stream = socket.create_server((address, 0))
    threading.Thread(target=_send_forever, args=(stream, memoryview(buffer.numpy()).cast("B")), daemon=True).start()
    print(json.dumps({"side_port": side.port, "stream_port": stream.getsockname()[1], "transports": describe()}),
          flush=True)
    while True:
        transport.get_notifs()  # progresses the agent: over TCP, P's side of a READ runs here
        time.sleep(poll_s)


def _send_forever(server: socket.socket, data: memoryview) -> None:
    while True:
        connection, _ = server.accept()
        with connection:
            while asked := connection.recv(LENGTH):
                connection.sendall(data[:int.from_bytes(asked, "little")])


def bench_d(p_address: str, address: str, block_bytes: int, args: dict) -> dict:
    """D in host B (`--bench-d`): READs from P and TCP rounds from P's sender, in turns;
    the times."""
    from connectors.nixl.transport import NixlTransport

    configure_ucx(address)
    count, num_blocks = args["count"], args["num_blocks"]
    remote_ids = [1 + 2 * i for i in range(count)]
    local_ids = remote_ids[::-1]
    dst = torch.ones((num_blocks, block_bytes), dtype=torch.int8)  # every page touched
    d = NixlTransport("D-hosts", _caches(dst))
    d.add_peer(fetch_remote_layout(p_address, args["side_port"], HandshakeRequest("D-hosts", "hosts"), 10.0))
    stream = socket.create_connection((p_address, args["stream_port"]))
    received = bytearray(count * block_bytes)
    view = memoryview(received)

    def nixl() -> None:
        timed_read(d, "P-hosts", [local_ids], [remote_ids], b"")

    def tcp() -> None:
        stream.sendall(len(received).to_bytes(LENGTH, "little"))
        got = 0
        while got < len(received):
            got += stream.recv_into(view[got:])

    dst.zero_()
    nixl()
    source = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8,
                           generator=torch.Generator().manual_seed(P_SEED))
    correct = torch.equal(dst[torch.tensor(local_ids)], source[torch.tensor(remote_ids)])
    tcp()
    times: dict[str, list[float]] = {"nixl": [], "tcp": []}
    for i in range(args["repeats"]):
        for name, fn in (("nixl", nixl), ("tcp", tcp))[::1 if i % 2 else -1]:
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    stream.close()
    d.close()
    return {"times": times, "correct": correct, "transports": describe(),
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}


def bench_block_size(net: Network, block_bytes: int, args: argparse.Namespace) -> dict:
    a, b = net.hosts
    count = max(4, (args.read_mib << 20) // block_bytes)
    num_blocks = 2 * count + 1
    me = [sys.executable, "-m", "benchmarks.transfer_hosts"]
    p = net.popen(a, [*me, "--serve-p", json.dumps([a.address, num_blocks, block_bytes, args.peer_poll_ms / 1000])],
                  stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(p.stdout.readline())
        d = net.popen(b, [*me, "--bench-d", json.dumps([a.address, b.address, block_bytes, info | {
            "count": count, "num_blocks": num_blocks, "repeats": args.repeats}])], stdout=subprocess.PIPE, text=True)
        result = json.loads(d.communicate(timeout=600)[0])
    finally:
        p.terminate()  # this run's P, by PID
        p.wait(30)
    if not result["correct"]:
        raise AssertionError("the READ landed the wrong bytes")
    times, num_bytes = result["times"], count * block_bytes
    row = {"block_bytes": block_bytes, "blocks": count, "bytes": num_bytes, "p": info["transports"],
           "d": result["transports"], "d_max_rss_mib": result["max_rss_mib"]}
    for name, values in times.items():
        row[f"{name}_gbps"] = round(num_bytes / statistics.median(values) / 1e9, 3)
    row["nixl_over_tcp"] = round(statistics.median(t / n for n, t in zip(times["nixl"], times["tcp"])), 3)
    return row


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer_hosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[64, 256, 1024, 4096],
                        help="block sizes in KiB (default 64 256 1024 4096)")
    parser.add_argument("--read-mib", type=int, default=64, help="MiB a READ moves (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each, in turns (default 5)")
    parser.add_argument("--peer-poll-ms", type=float, default=1.0,
                        help="how often P polls its agent, ms (default 1: an engine step at its shortest)")
    parser.add_argument("--serve-p", help=argparse.SUPPRESS)  # the run's own P, in host A
    parser.add_argument("--bench-d", help=argparse.SUPPRESS)  # the run's own D, in host B
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    args = parse_args(argv)
    if args.serve_p:
        serve_p(*json.loads(args.serve_p))
        return None
    if args.bench_d:
        print(json.dumps(bench_d(*json.loads(args.bench_d))))
        return None
    if (why := unavailable()) is not None:
        sys.exit(f"no test hosts here: {why}")
    with Network(2) as net:
        rows = [bench_block_size(net, kib << 10, args) for kib in args.block_kib]
    print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
