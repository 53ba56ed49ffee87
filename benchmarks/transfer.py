"""NIXL READ bandwidth for one request's KV blocks, beside a plain torch copy of the same bytes.

For each tiny architecture, builds the KV cache config the engine would build
(`model.kv_cache_specs(16)` -> `make_kv_cache_config`) in both layouts. A spawned P process
owns a KV cache filled with a pattern, serves the side channel and polls NIXL every
`--peer-poll-ms` (as an engine step would); this process is D. One "request" is N blocks
per KV cache group, allocated on each side as 2-4 runs at random places, so the paired
lists split into a few more runs. Timed per repeat, medians reported:

- NIXL: `start_read` (descriptors built per transfer) + `poll` until DONE, the READ
  carrying a ReadDone notification as the connector sends it. DONE waits until the
  notification reached P's agent, so P's poll interval is part of this figure;
- NIXL no notif: the same READ without a notification (data movement alone);
- torch gather: `dst.index_copy_(0, local, src.index_select(0, remote))` per tensor and
  group over the same paired blocks, inside one process (two passes over the bytes; rows
  viewed as int64 where they allow, as torch's int8 index_copy_ is ~5x slower);
- torch run copy: `dst[l:l+n].copy_(src[r:r+n])` per run (one pass; a memcpy bound).

    python -m benchmarks.transfer --arch qwen3 gemma3 bamba granitehybrid --num-blocks 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout
from connectors.nixl.messages import HandshakeRequest, HandshakeResponse, ReadDone, compat_hash, encode_notif
from connectors.nixl.transport import NixlTransport, TransferHandle, paired_runs
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import KVCacheConfig
from pd.models.config import ModelConfig
from pd.models.loader import load_model
from pd.models.make_model import ARCHS, make_model
from pd.worker.kv_allocation import KVCacheAllocation, allocate_kv_caches

BLOCK_SIZE = 16
LAYOUTS = ("canonical", "per-layer")
P_SEED, D_SEED = 11, 22
POLL_DEADLINE_S = 30.0


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
    return compat_hash(arch, dtype, [g.spec.block_size for g in config.groups], layout,
                       [repr(g.spec) for g in config.groups])


def serve_peer(conn, engine_id: str, config: KVCacheConfig, layout: str, my_hash: str, poll_s: float) -> None:
    """P: serve the side channel and poll NIXL every `poll_s` until the pipe says stop."""
    transport = NixlTransport(engine_id, fill(config, layout, P_SEED).describe(),
                              block_sizes=[g.spec.block_size for g in config.groups])
    server = SideChannelServer("127.0.0.1", 0, lambda request: HandshakeResponse(
        transport.agent_metadata(), transport.local_layout(my_hash)))
    try:
        conn.send(server.port)
        while not conn.poll(poll_s):
            transport.get_notifs()
    finally:
        server.close()
        transport.close()


@dataclass
class Peer:
    process: mp.Process
    conn: object
    port: int

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_peer(engine_id: str, config: KVCacheConfig, layout: str, my_hash: str, poll_s: float) -> Peer:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve_peer, args=(child, engine_id, config, layout, my_hash, poll_s), daemon=True)
    process.start()
    if not parent.poll(120):
        process.kill()
        process.join()
        raise RuntimeError(f"peer {engine_id} did not start")
    return Peer(process, parent, parent.recv())


def timed_read(d: NixlTransport, peer_id: str, local: list[list[int]], remote: list[list[int]],
               notif: bytes) -> tuple[float, TransferHandle]:
    started = time.perf_counter()
    handle = d.start_read(peer_id, local, remote, notif)
    while d.poll(handle) == "PROC":
        if time.perf_counter() - started > POLL_DEADLINE_S:
            raise RuntimeError(f"READ from {peer_id} still in progress after {POLL_DEADLINE_S} s")
    if handle.state != "DONE":
        raise RuntimeError(f"READ from {peer_id} failed: {handle.error}")
    return time.perf_counter() - started, handle


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
        li = torch.tensor([l for l, r in zip(lids, rids) if l and r])
        ri = torch.tensor([r for l, r in zip(lids, rids) if l and r])
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
            for l, r, n in runs:
                dst[l:l + n].copy_(src[r:r + n])

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


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def bench_one(arch: str, layout: str, config: KVCacheConfig, args: argparse.Namespace) -> dict:
    my_hash = layout_hash(arch, args.dtype, layout, config)
    peer_id, d_id = f"P-{arch}-{layout}", f"D-{arch}-{layout}"
    peer = start_peer(peer_id, config, layout, my_hash, args.peer_poll_ms / 1000)
    d = None
    try:
        d_alloc = fill(config, layout, D_SEED)
        d = NixlTransport(d_id, d_alloc.describe(), block_sizes=[g.spec.block_size for g in config.groups])
        d.add_peer(fetch_remote_layout("127.0.0.1", peer.port, HandshakeRequest(d_id, my_hash), 10.0),
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
    runs_per_group = [len(paired_runs(l, r)) for l, r in zip(local, remote)]
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--arch", nargs="+", choices=sorted(ARCHS), default=["qwen3", "gemma3", "bamba", "granitehybrid"])
    add("--num-blocks", type=int, default=256, help="blocks per KV cache group in the request")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add("--repeats", type=int, default=10)
    add("--peer-poll-ms", type=float, default=1.0, help="how often P polls NIXL (its engine step)")
    add("--output", type=Path, default=Path("results/transfer.json"))
    args = p.parse_args(argv)
    if args.num_blocks < 4 or args.repeats < 1:
        p.error("--num-blocks must be at least 4 and --repeats at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as model_root:
        for arch in args.arch:
            config = kv_config(arch, args.dtype, args.num_blocks, Path(model_root))
            rows += [bench_one(arch, layout, config, args) for layout in LAYOUTS]
    print(f"One request of {args.num_blocks} blocks per group, {args.dtype}, P polls every "
          f"{args.peer_poll_ms:g} ms; medians of {args.repeats} repeats.")
    print(format_table(rows))
    result = {
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": {"python": sys.version, "platform": platform.platform(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
