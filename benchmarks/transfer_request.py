"""One request's KV read per tiny architecture, canonical vs per-layer layout
(`python -m benchmarks.transfer --arch ...`): the engine's own KV cache config, blocks
as 2-4 runs at random places, NIXL with and without the read-done notification beside
an in-process torch gather (`index_copy_`, two passes) and run copy (`copy_` per run)."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.transfer_peer import D_SEED, P_SEED, start_peer, timed, timed_read
from connectors.nixl.descriptors import paired_runs
from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout
from connectors.nixl.peer_messages import HandshakeRequest, HandshakeResponse, ReadDone, encode_notif
from connectors.nixl.transport import NixlTransport
from pd.kv_cache.allocation import KVCacheAllocation, allocate_kv_caches
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import KVCacheConfig
from pd.kv_transfer.compat import compat_hash
from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig

BLOCK_SIZE = 16
LAYOUTS = ("canonical", "per-layer")


def kv_config(arch: str, dtype: str, blocks_per_group: int, model_root: Path) -> KVCacheConfig:
    """The engine's KV cache config for the tiny `arch`, sized to hold two requests' worth
    of blocks per group (plus the null block and gaps)."""
    model = load_model(ModelConfig.from_dir(make_model(arch, model_root / arch), dtype))
    specs = model.kv_cache_specs(BLOCK_SIZE)
    probe = make_kv_cache_config(specs, 1 << 40)  # only to learn the row bytes and group count
    blocks = len(probe.groups) * blocks_per_group * 2 + 64
    return make_kv_cache_config(specs, blocks * probe.cross_layer_page_bytes)


def request_blocks(config: KVCacheConfig, n: int, seed: int) -> list[list[int]]:
    """N block ids per group as 2-4 runs at random places; groups' blocks are disjoint."""
    rng = random.Random(seed)
    free = list(range(1, config.num_blocks))  # block 0 is the null block
    region = len(free) // len(config.groups)
    blocks = []
    for g in range(len(config.groups)):
        k = rng.randint(2, 4)
        cuts = sorted(rng.sample(range(1, n), k - 1))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        slack = region - n
        gaps = sorted(rng.sample(range(slack + 1), k))  # k increasing offsets within the slack
        start, ids = g * region + 1, []
        for size, gap, prev in zip(sizes, gaps, [0, *gaps]):
            start += gap - prev
            ids += list(range(start, start + size))
            start += size
        blocks.append(ids)
    return blocks


def fill(config: KVCacheConfig, layout: str, seed: int) -> KVCacheAllocation:
    alloc = allocate_kv_caches(config, "cpu", layout)
    gen = torch.Generator().manual_seed(seed)
    for buf in alloc.buffers:  # also touches every page, so no first-touch faults are timed
        buf.copy_(torch.randint(-128, 128, buf.shape, generator=gen, dtype=torch.int8))
    return alloc


def layout_hash(arch: str, dtype: str, layout: str, config: KVCacheConfig) -> str:
    return compat_hash(arch, "random", "none", dtype, config.block_sizes, layout,
                       [repr(g.spec) for g in config.groups])


def serve_peer(conn, engine_id: str, config: KVCacheConfig, layout: str, my_hash: str, poll_s: float) -> None:
    """P: serve the side channel and poll NIXL every `poll_s` until the pipe says stop."""
    transport = NixlTransport(engine_id, fill(config, layout, P_SEED).describe(),
                              block_sizes=config.block_sizes)
    server = SideChannelServer("127.0.0.1", 0, lambda request: HandshakeResponse(
        transport.agent_metadata(), transport.local_layout(my_hash)))
    try:
        conn.send(server.port)
        while not conn.poll(poll_s):
            transport.get_notifs()
    finally:
        server.close()
        transport.close()


def check_landed(d_alloc: KVCacheAllocation, source: list[torch.Tensor], local, remote) -> None:
    caches = d_alloc.describe()
    for g, (lids, rids) in enumerate(zip(local, remote)):
        li, ri = torch.tensor(lids), torch.tensor(rids)
        for ref in caches.group_data_refs[g]:
            cols = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
            got = d_alloc.buffers[ref.tensor_idx][li, cols]
            if not torch.equal(got, source[ref.tensor_idx][ri, cols]):
                raise AssertionError(f"group {g}: the READ moved the wrong bytes")


def torch_copies(d_alloc: KVCacheAllocation, source: list[torch.Tensor], local, remote):
    """(gather, run copy) closures copying the same group bytes within this process."""
    caches = d_alloc.describe()
    plan = []  # (dst view, src view, local index, remote index, runs)
    for g, (lids, rids) in enumerate(zip(local, remote)):
        runs = paired_runs(lids, rids)
        li = torch.tensor([lid for lid, rid in zip(lids, rids) if lid and rid])
        ri = torch.tensor([rid for lid, rid in zip(lids, rids) if lid and rid])
        for ref in caches.group_data_refs[g]:
            dst, src = d_alloc.buffers[ref.tensor_idx], source[ref.tensor_idx]
            if ref.page_size_bytes != dst.shape[1]:
                cols = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
                dst, src = dst[:, cols], src[:, cols]
            plan.append((_widest(dst), _widest(src), li, ri, runs))

    def gather() -> None:
        for dst, src, li, ri, _ in plan:
            dst.index_copy_(0, li, src.index_select(0, ri))

    def run_copy() -> None:
        for dst, src, _, _, runs in plan:
            for lid, rid, n in runs:
                dst[lid:lid + n].copy_(src[rid:rid + n])

    return gather, run_copy


def _widest(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as the widest integer elements that fit: torch's int8 `index_copy_`
    runs at ~1 GB/s here, int64 at ~5.6, and the baseline should be torch at its best."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return t.view(dtype)
        except RuntimeError:
            continue
    return t


def bench_one(arch: str, layout: str, config: KVCacheConfig, args: argparse.Namespace) -> dict:
    my_hash = layout_hash(arch, args.dtype, layout, config)
    peer_id, d_id = f"P-{arch}-{layout}", f"D-{arch}-{layout}"
    peer = start_peer(serve_peer, peer_id, config, layout, my_hash, args.peer_poll_ms / 1000)
    d = None
    try:
        d_alloc = fill(config, layout, D_SEED)
        d = NixlTransport(d_id, d_alloc.describe(), block_sizes=config.block_sizes)
        d.add_peer(fetch_remote_layout("127.0.0.1", peer.info, HandshakeRequest(d_id, my_hash), 10.0),
                   expected_compat_hash=my_hash)
        local = request_blocks(config, args.num_blocks, seed=1)
        remote = request_blocks(config, args.num_blocks, seed=2)
        source = fill(config, layout, P_SEED).buffers  # P's bytes, for checking and for torch
        notif = encode_notif(ReadDone("bench-request"))
        _, handle = timed_read(d, peer_id, local, remote, notif)  # connects; then check the bytes
        check_landed(d_alloc, source, local, remote)
        with_notif = timed(lambda: timed_read(d, peer_id, local, remote, notif), args.repeats)
        no_notif = timed(lambda: timed_read(d, peer_id, local, remote, b""), args.repeats)
        gather, run_copy = torch_copies(d_alloc, source, local, remote)
        gather_s, run_copy_s = timed(gather, args.repeats), timed(run_copy, args.repeats)
    finally:
        if d is not None:
            d.close()
        peer.stop()
    gbps = lambda times: handle.num_bytes / statistics.median(times) / 1e9  # noqa: E731
    runs_per_group = [len(paired_runs(lids, rids)) for lids, rids in zip(local, remote)]
    return {
        "arch": arch, "layout": layout, "dtype": args.dtype, "groups": len(config.groups),
        "layers_per_group": [len(g.layer_names) for g in config.groups],
        "blocks_per_group": args.num_blocks, "runs_per_group": runs_per_group,
        "bytes": handle.num_bytes, "descriptors": handle.num_descriptors,
        "nixl_gbps": gbps(with_notif), "nixl_no_notif_gbps": gbps(no_notif),
        "torch_gather_gbps": gbps(gather_s), "torch_run_copy_gbps": gbps(run_copy_s),
        "nixl_median_ms": statistics.median(with_notif) * 1e3,
        "nixl_no_notif_median_ms": statistics.median(no_notif) * 1e3,
    }


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| arch | layout | blocks/group | bytes | descriptors | NIXL GB/s | NIXL no-notif GB/s "
             "| torch gather GB/s | torch run-copy GB/s | NIXL / torch gather |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['layout']} | {r['blocks_per_group']} | {r['bytes'] / 2**20:.1f} MiB "
                     f"| {r['descriptors']} | {r['nixl_gbps']:.2f} | {r['nixl_no_notif_gbps']:.2f} "
                     f"| {r['torch_gather_gbps']:.2f} | {r['torch_run_copy_gbps']:.2f} "
                     f"| {r['nixl_gbps'] / r['torch_gather_gbps']:.2f} |")
    return "\n".join(lines)
