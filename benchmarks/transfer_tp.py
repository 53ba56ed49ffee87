"""The heterogeneous tensor-parallel sweep of `benchmarks/transfer.py` (`--tp-pairs`).

For a (P TP, D TP) pair and a block size: P's ranks are processes, each holding its
heads of every block (a block of B bytes has 4 heads; rank r of t holds B / t bytes of
it); D's rank 0 reads `--read-mib` of its heads of scattered blocks from the P ranks
that hold them (every other block, reversed: no run of blocks merges), timed as

- NIXL: one READ per P rank, posted together and polled until all are DONE; descriptors
  are what the connector's `piece_runs` plans: one per block per P rank it reads from;
- CMA: `process_vm_readv` of the same (local, remote) ranges from each P process.

Interleaved, each first in every other round; NIXL / CMA is the median of the rounds'
ratios, as in the block sweep.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks.transfer_peer import P_SEED, POLL_DEADLINE_S, cma_read, interleaved, start_peer, sweep_row
from connectors.nixl.descriptors import piece_ranges, piece_runs
from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout
from connectors.nixl.peer_messages import DataRefInfo, HandshakeRequest, HandshakeResponse, TensorInfo
from connectors.nixl.transport import NixlTransport
from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor
from pd.kv_cache.row_order import Piece

HEADS = 4
HASH = "transfer-tp"


def rank_caches(tensor: torch.Tensor, tp: int, rank: int) -> CanonicalKVCaches:
    """One group whose rows hold heads `[rank * HEADS / tp, ...)`, heads outermost."""
    count = HEADS // tp
    head = tensor.shape[1] // count
    pieces = tuple(Piece(("head", rank * count + i), i * head, head) for i in range(count))
    return CanonicalKVCaches([KVCacheBlockTensor(tensor)], [[KVCacheBlockDataRef(0, tensor.shape[1])]], [pieces])


def rank_bytes(num_blocks: int, block_bytes: int, tp: int, rank: int) -> torch.Tensor:
    """P rank `rank`'s buffer: its heads of one-rank blocks of seeded random bytes."""
    whole = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(P_SEED))
    share = block_bytes // tp
    return whole[:, rank * share : (rank + 1) * share].contiguous()


def serve_rank(conn, engine_id: str, num_blocks: int, block_bytes: int, tp: int, rank: int, poll_s: float) -> None:
    buffer = rank_bytes(num_blocks, block_bytes, tp, rank)
    transport = NixlTransport(engine_id, rank_caches(buffer, tp, rank))
    server = SideChannelServer("127.0.0.1", 0, lambda request: HandshakeResponse(
        transport.agent_metadata(), transport.local_layout(HASH)))
    try:
        conn.send((server.port, os.getpid()))
        while not conn.poll(poll_s):
            transport.get_notifs()
    finally:
        server.close()
        transport.close()


def bench_pair(block_bytes: int, p_tp: int, d_tp: int, args: argparse.Namespace) -> dict:
    count = max(4, (args.read_mib << 20) * d_tp // block_bytes)  # blocks D rank 0 reads `--read-mib` of
    num_blocks = 2 * count + 1
    remote_ids = [1 + 2 * i for i in range(count)]
    local_ids = remote_ids[::-1]
    names = [f"P-tp{p_tp}x{d_tp}-{rank}-{block_bytes}" for rank in range(p_tp)]
    peers = [start_peer(serve_rank, name, num_blocks, block_bytes, p_tp, rank, args.peer_poll_ms / 1000)
             for rank, name in enumerate(names)]
    d = None
    try:
        dst = torch.ones((num_blocks, block_bytes // d_tp), dtype=torch.int8)  # pages touched before timing
        d = NixlTransport(f"D-tp{p_tp}x{d_tp}-{block_bytes}", rank_caches(dst, d_tp, 0))
        layouts = []
        for peer in peers:
            response = fetch_remote_layout("127.0.0.1", peer.info[0], HandshakeRequest(d.engine_id, HASH), 10.0)
            d.add_peer(response, expected_compat_hash=HASH)
            layouts.append(response.layout)
        ranges = _cma_ranges(d, layouts, local_ids, remote_ids)
        readers = [i for i, r in enumerate(ranges) if r[0]]

        def nixl() -> int:
            taken = [set()]
            handles = [d.start_read(names[i], [local_ids], [remote_ids], taken=taken) for i in readers]
            started = time.perf_counter()
            while any(d.poll(h) == "PROC" for h in handles):
                if time.perf_counter() - started > POLL_DEADLINE_S:
                    raise RuntimeError("a READ is still in progress")
            if any(h.state != "DONE" for h in handles):
                raise RuntimeError(f"a READ failed: {[h.error for h in handles]}")
            return sum(h.num_descriptors for h in handles)

        def cma() -> None:
            for i in readers:
                local, remote = ranges[i]
                if cma_read(peers[i].info[1], local, remote) != sum(n for _, n in local):
                    raise RuntimeError("process_vm_readv copied short")

        expected = rank_bytes(num_blocks, block_bytes, d_tp, 0)[remote_ids]
        descriptors = 0
        for fn in (nixl, cma):
            dst.zero_()
            descriptors = fn() or descriptors
            if not torch.equal(dst[local_ids], expected):
                raise AssertionError(f"{fn.__name__} moved the wrong bytes")
        times = interleaved({"nixl": nixl, "cma": cma}, args.repeats)
    finally:
        if d is not None:
            d.close()
        for peer in peers:
            peer.stop()
    return {"p_tp": p_tp, "d_tp": d_tp, "descriptors": descriptors, "p_ranks_read": len(readers),
            **sweep_row(block_bytes, count, count * block_bytes // d_tp, times)}


def _cma_ranges(d: NixlTransport, layouts, local_ids: list[int], remote_ids: list[int]) -> list:
    """Per P rank, the (address, length) ranges D rank 0 reads from it, local and remote:
    the same plan as the NIXL READ (`piece_runs`, each head from one rank)."""
    taken = [set()]
    ours = d.local_layout(HASH)
    out = []
    for layout in layouts:
        runs = piece_runs(ours.group_pieces, layout.group_pieces, taken)
        if runs is None:  # the same heads: whole rows
            runs = [[(0, 0, ours.group_data_refs[0][0].page_size_bytes)]]
        out.append(tuple(_ranges(info, refs[0][0], ids, runs[0], side) for info, refs, ids, side in
                         ((ours.tensors[0], ours.group_data_refs, local_ids, 1),
                          (layout.tensors[0], layout.group_data_refs, remote_ids, 0))))
    return out


def _ranges(tensor: TensorInfo, ref: DataRefInfo, ids: list[int], runs, side: int) -> list[tuple[int, int]]:
    rows = piece_ranges(tensor, ref, np.asarray(ids, dtype=np.int64), runs, side)
    return [(int(a), int(n)) for a, n, _ in rows]


def format_pairs(rows: list[dict]) -> str:
    lines = ["| P TP | D TP | block | blocks read | P ranks read | descriptors | NIXL GB/s | CMA GB/s | NIXL / CMA |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        size = r["block_bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(f"| {r['p_tp']} | {r['d_tp']} | {label} | {r['blocks']} | {r['p_ranks_read']} "
                     f"| {r['descriptors']} | {r['nixl_gbps']:.2f} | {r['cma_gbps']:.2f} | {r['nixl_over_cma']:.2f} |")
    return "\n".join(lines)
