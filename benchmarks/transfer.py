"""KV transfer speed between two processes on this host: NIXL READ against the physical
limits, a single CMA copy (`process_vm_readv`) and an in-process copy.

**Block sweep** (always): for each block size (4 KiB-4 MiB), one READ of `--read-mib`
of blocks scattered in both KV caches (every other block, in reverse order on D, so each
block is its own descriptor: no run merges), timed three ways, medians reported (NIXL
and CMA interleaved, each first in every other round; NIXL / CMA is the median of the
rounds' ratios):

- NIXL READ: `NixlTransport.start_read` + `poll` until DONE, no notification (the data
  movement; UCX reads with one CMA copy per descriptor on one host);
- CMA: `process_vm_readv` of the same block pairs, as few calls as IOV_MAX allows: the
  copy UCX's cma transport makes, with no per-descriptor overhead;
- memcpy: `dst[l].copy_(src[r])` per block inside one process (no kernel in between;
  Python-bound for small blocks).

Then NIXL + notif: the same READ carrying a read-done notification, as the connector
sends it; DONE waits until P's agent took the notification, so P's poll interval
(`--peer-poll-ms`, its engine step) is part of that figure.

And `--kv-digest`'s cost: NIXL READ + check, the READ followed by D's check of every
block read against P's digests (`pd/kv_transfer/digests.py`, as the NIXL worker does),
interleaved with the READ alone; "check / READ" is the median of the rounds' (checked -
READ) / READ. P pays about as much again when it digests the blocks (not timed here: the
same hashing, at the end of the step that computed them).

**Per architecture** (`--arch ...`): one request's read with each tiny architecture's
real KV cache config, canonical vs per-layer layout (`benchmarks/transfer_request.py`).

**Heterogeneous tensor parallelism** (`--tp-pairs 1x2 2x1 2x2`): a decode rank reading
its heads of each block from the prefill ranks that hold them, NIXL against CMA for the
same ranges, per block size (`benchmarks/transfer_tp.py`).

    python -m benchmarks.transfer                      # the block sweep
    python -m benchmarks.transfer --arch qwen3 gemma3 bamba granitehybrid --num-blocks 256
    python -m benchmarks.transfer --tp-pairs 1x2 2x1 2x2 --block-kib 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from benchmarks.transfer_peer import P_SEED, cma_read, interleaved, start_peer, sweep_row, timed, timed_read
from benchmarks.transfer_request import LAYOUTS, bench_one, format_table, kv_config
from benchmarks.transfer_tp import bench_pair, format_pairs
from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout
from connectors.nixl.peer_messages import HandshakeRequest, HandshakeResponse, ReadDone, encode_notif
from connectors.nixl.transport import NixlTransport
from connectors.nixl.ucx import configure_ucx
from pd.models.make_model import ARCHS


def block_caches(tensor: torch.Tensor):
    """One KV cache group whose block is one whole row of `tensor`."""
    from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor

    return CanonicalKVCaches([KVCacheBlockTensor(tensor)], [[KVCacheBlockDataRef(0, tensor.shape[1])]])


def serve_block_peer(conn, engine_id: str, num_blocks: int, block_bytes: int, poll_s: float) -> None:
    """P for the sweep: a (num_blocks, block_bytes) buffer of random bytes, the side
    channel, NIXL polled every `poll_s`; sends (port, pid, buffer address)."""
    buffer = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8,
                           generator=torch.Generator().manual_seed(P_SEED))
    transport = NixlTransport(engine_id, block_caches(buffer))
    server = SideChannelServer("127.0.0.1", 0, lambda request: HandshakeResponse(
        transport.agent_metadata(), transport.local_layout("sweep")))
    try:
        conn.send((server.port, os.getpid(), buffer.data_ptr()))
        while not conn.poll(poll_s):
            transport.get_notifs()
    finally:
        server.close()
        transport.close()


def bench_block_size(block_bytes: int, args: argparse.Namespace) -> dict:
    count = max(4, (args.read_mib << 20) // block_bytes)  # blocks in the read
    num_blocks = 2 * count + 1  # every other block, from 1 (0 is the null block)
    remote_ids = [1 + 2 * i for i in range(count)]
    local_ids = remote_ids[::-1]
    peer_id, d_id = f"P-sweep-{block_bytes}", f"D-sweep-{block_bytes}"
    peer = start_peer(serve_block_peer, peer_id, num_blocks, block_bytes, args.peer_poll_ms / 1000)
    d = None
    try:
        port, pid, remote_base = peer.info
        dst = torch.zeros((num_blocks, block_bytes), dtype=torch.int8)
        dst.fill_(1)  # touch every page: no first-touch faults are timed
        d = NixlTransport(d_id, block_caches(dst))
        d.add_peer(fetch_remote_layout("127.0.0.1", port, HandshakeRequest(d_id, "sweep"), 10.0))
        source = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8,
                               generator=torch.Generator().manual_seed(P_SEED))  # P's bytes
        local = [(dst.data_ptr() + b * block_bytes, block_bytes) for b in local_ids]
        remote = [(remote_base + b * block_bytes, block_bytes) for b in remote_ids]
        copy_dst = torch.zeros_like(dst)
        copy_dst.fill_(1)

        def nixl(notif: bytes = b"") -> None:
            timed_read(d, peer_id, [local_ids], [remote_ids], notif)

        def cma() -> None:
            if cma_read(pid, local, remote) != count * block_bytes:
                raise RuntimeError("process_vm_readv copied short")

        def memcpy() -> None:
            for lid, rid in zip(local_ids, remote_ids):
                copy_dst[lid].copy_(source[rid])

        li, ri = torch.tensor(local_ids), torch.tensor(remote_ids)
        for fn in (nixl, cma):  # each lands P's bytes exactly where they belong
            dst.fill_(0)
            fn()
            if not torch.equal(dst[li], source[ri]):
                raise AssertionError(f"{fn.__name__} moved the wrong bytes")
        times = interleaved({"nixl": nixl, "cma": cma}, args.repeats)
        check = digest_check(block_caches(dst), block_caches(source), [local_ids], [remote_ids])
        checked = interleaved({"nixl": nixl, "nixl_checked": lambda: (nixl(), check())}, args.repeats)
        times["nixl_checked"] = checked["nixl_checked"]
        times["check_share"] = [c / n - 1 for n, c in zip(checked["nixl"], checked["nixl_checked"])]
        times["memcpy"] = timed(memcpy, args.repeats)  # apart: its writes to another buffer would
        # be written back during whatever ran next
        notif = encode_notif(ReadDone("bench-request"))
        times["nixl_notif"] = timed(lambda: nixl(notif), args.repeats)
    finally:
        if d is not None:
            d.close()
        peer.stop()
    return sweep_row(block_bytes, count, count * block_bytes, times)


def digest_check(ours, holders, local_ids: list[list[int]], remote_ids: list[list[int]]):
    """D's check of a READ's blocks against the holder's digests of them (made here from
    `holders`, the same bytes as P's), as the NIXL worker runs it; raises on a mismatch."""
    from pd.kv_transfer.digests import BlockDigests, mismatch

    mine, theirs = BlockDigests(ours), BlockDigests(holders)
    blob, keys = theirs.request(remote_ids), [theirs.unit_keys(g) for g in range(len(remote_ids))]
    read = [set(group_keys) for group_keys in keys]

    def check() -> None:
        why = mismatch(mine, local_ids, remote_ids, read, blob, keys)
        if why is not None:
            raise AssertionError(f"the READ brought other bytes: {why}")
    return check


def format_sweep(rows: Sequence[dict]) -> str:
    lines = ["| block | blocks | MiB | NIXL READ GB/s | CMA GB/s | memcpy GB/s | NIXL / CMA | NIXL + notif GB/s "
             "| READ + check GB/s | check / READ |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        size = r["block_bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(f"| {label} | {r['blocks']} | {r['bytes'] / 2**20:.0f} | {r['nixl_gbps']:.2f} "
                     f"| {r['cma_gbps']:.2f} | {r['memcpy_gbps']:.2f} | {r['nixl_over_cma']:.2f} "
                     f"| {r['nixl_notif_gbps']:.2f} | {r['nixl_checked_gbps']:.2f} | {r['check_share']:.1%} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--block-kib", nargs="+", type=int, default=[4, 16, 64, 256, 1024, 4096],
        help="block sizes of the sweep, in KiB (default 4 16 64 256 1024 4096)")
    add("--read-mib", type=int, default=64, help="bytes of one READ in the sweep, in MiB (default 64)")
    add("--arch", nargs="*", choices=sorted(ARCHS), default=[],
        help="also time one request's read with these tiny architectures' KV cache configs (default: none)")
    add("--num-blocks", type=int, default=256, help="blocks per KV cache group in the --arch request (default 256)")
    add("--ucx-transports", default="auto", metavar="UCX_TLS",
        help="UCX transports, as pd serve's --kv-ucx-transports (default auto: sm,self,tcp on one host)")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="KV dtype of the --arch configs (default float32)")
    add("--repeats", type=int, default=10, help="timed repeats per figure; medians are reported (default 10)")
    add("--peer-poll-ms", type=float, default=1.0, help="how often P polls NIXL (its engine step)")
    add("--tp-pairs", nargs="*", default=[], metavar="PxD",
        help="also sweep reads between tensor-parallel sizes, e.g. 1x2 2x1 2x2 (P TP x D TP; default: none)")
    add("--skip-block-sweep", action="store_true", help="only the --arch and --tp-pairs parts")
    add("--output", type=Path, default=Path("results/transfer.json"),
        help="where the JSON goes (default results/transfer.json)")
    args = p.parse_args(argv)
    try:
        args.tp_pairs = [tuple(int(x) for x in pair.split("x")) for pair in args.tp_pairs]
    except ValueError:
        p.error("--tp-pairs takes PxD pairs such as 1x2")
    if any(len(pair) != 2 or min(pair) < 1 or 4 % pair[0] or 4 % pair[1] for pair in args.tp_pairs):
        p.error("--tp-pairs: P and D TP sizes must divide 4 (the sweep's heads)")
    if args.num_blocks < 4 or args.repeats < 1 or args.read_mib < 1 or min(args.block_kib) < 1:
        p.error("--num-blocks must be at least 4, --repeats, --read-mib and --block-kib at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    configure_ucx("127.0.0.1", args.ucx_transports)  # as a one-host deployment; spawned peers inherit it
    sweep = [] if args.skip_block_sweep else [bench_block_size(kib << 10, args) for kib in args.block_kib]
    if sweep:
        print(f"One READ of {args.read_mib} MiB of scattered blocks between two processes, UCX_TLS="
              f"{os.environ.get('UCX_TLS')}; medians of {args.repeats} interleaved repeats; P polls every "
              f"{args.peer_poll_ms:g} ms (the notif column).")
        print(format_sweep(sweep))
    tp_rows = [bench_pair(kib << 10, p_tp, d_tp, args) for p_tp, d_tp in args.tp_pairs for kib in args.block_kib]
    if tp_rows:
        print(f"\nDecode rank 0 reading {args.read_mib} MiB of its heads of scattered blocks from the prefill ranks "
              f"holding them (block: the whole block's bytes); medians of {args.repeats} interleaved repeats.")
        print(format_pairs(tp_rows))
    rows = []
    with tempfile.TemporaryDirectory() as model_root:
        for arch in args.arch:
            config = kv_config(arch, args.dtype, args.num_blocks, Path(model_root))
            rows += [bench_one(arch, layout, config, args) for layout in LAYOUTS]
    if rows:
        print(f"\nOne request of {args.num_blocks} blocks per group, {args.dtype}, P polls every "
              f"{args.peer_poll_ms:g} ms; medians of {args.repeats} repeats.")
        print(format_table(rows))
    result = {
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": {"python": sys.version, "platform": platform.platform(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                        "ucx_tls": os.environ.get("UCX_TLS"), "ucx_net_devices": os.environ.get("UCX_NET_DEVICES")},
        "sweep": sweep,
        "rows": rows,
        "tp_pairs": tp_rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
