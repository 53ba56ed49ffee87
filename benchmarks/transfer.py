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

**Per architecture** (`--arch ...`): one request of `--num-blocks` blocks per KV cache
group of the engine's real KV cache config (`model.kv_cache_specs(16)` ->
`make_kv_cache_config`), canonical and per-layer layouts, blocks as 2-4 runs at random
places; NIXL with and without the notification beside an in-process torch gather
(`index_copy_`, two passes) and run copy (`copy_` per run).

    python -m benchmarks.transfer                      # the block sweep
    python -m benchmarks.transfer --arch qwen3 gemma3 bamba granitehybrid --num-blocks 256
"""

from __future__ import annotations

import argparse
import ctypes
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
from connectors.nixl.transport import NixlTransport, TransferHandle, configure_ucx, paired_runs
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


IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux UIO_MAXIOV)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def cma_read(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> int:
    """Copy (address, length) ranges of process `pid` into ours with process_vm_readv,
    IOV_MAX ranges per call; returns the bytes copied."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    copied = 0
    for i in range(0, len(local), IOV_MAX):
        ours, theirs = local[i:i + IOV_MAX], remote[i:i + IOV_MAX]
        lv = (_IoVec * len(ours))(*[_IoVec(a, n) for a, n in ours])
        rv = (_IoVec * len(theirs))(*[_IoVec(a, n) for a, n in theirs])
        got = libc.process_vm_readv(pid, lv, len(ours), rv, len(theirs), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
        copied += got
    return copied


def block_caches(tensor: torch.Tensor):
    """One KV cache group whose block is one whole row of `tensor`."""
    from connectors.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor

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
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve_block_peer, args=(child, peer_id, num_blocks, block_bytes,
                                                         args.peer_poll_ms / 1000), daemon=True)
    process.start()
    peer = Peer(process, parent, 0)
    d = None
    try:
        if not parent.poll(120):
            raise RuntimeError(f"peer {peer_id} did not start")
        port, pid, remote_base = parent.recv()
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

        def nixl() -> None:
            timed_read(d, peer_id, [local_ids], [remote_ids], b"")

        def cma() -> None:
            if cma_read(pid, local, remote) != count * block_bytes:
                raise RuntimeError("process_vm_readv copied short")

        def memcpy() -> None:
            for l, r in zip(local_ids, remote_ids):
                copy_dst[l].copy_(source[r])

        li, ri = torch.tensor(local_ids), torch.tensor(remote_ids)
        for fn in (nixl, cma):  # each lands P's bytes exactly where they belong
            dst.fill_(0)
            fn()
            if not torch.equal(dst[li], source[ri]):
                raise AssertionError(f"{fn.__name__} moved the wrong bytes")
        times = {"nixl": [], "cma": []}
        for i in range(args.repeats):  # NIXL and CMA interleaved, each first in every other round
            for name, fn in (("nixl", nixl), ("cma", cma))[::1 if i % 2 else -1]:
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        times["memcpy"] = timed(memcpy, args.repeats)  # apart: its writes to another buffer would
        # be written back during whatever ran next
        notif = encode_notif(ReadDone("bench-request"))
        times["nixl_notif"] = timed(lambda: timed_read(d, peer_id, [local_ids], [remote_ids], notif), args.repeats)
    finally:
        if d is not None:
            d.close()
        peer.stop()
    num_bytes = count * block_bytes
    row = {"block_bytes": block_bytes, "blocks": count, "bytes": num_bytes, "ucx_tls": os.environ.get("UCX_TLS")}
    for name, values in times.items():
        row[f"{name}_gbps"] = num_bytes / statistics.median(values) / 1e9
        row[f"{name}_median_ms"] = statistics.median(values) * 1e3
    # each round's NIXL against the CMA copy next to it: the pairing cancels the machine's drift
    row["nixl_over_cma"] = statistics.median(c / n for n, c in zip(times["nixl"], times["cma"]))
    return row


def format_sweep(rows: Sequence[dict]) -> str:
    lines = ["| block | blocks | MiB | NIXL READ GB/s | CMA GB/s | memcpy GB/s | NIXL / CMA | NIXL + notif GB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        size = r["block_bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(f"| {label} | {r['blocks']} | {r['bytes'] / 2**20:.0f} | {r['nixl_gbps']:.2f} "
                     f"| {r['cma_gbps']:.2f} | {r['memcpy_gbps']:.2f} | {r['nixl_over_cma']:.2f} "
                     f"| {r['nixl_notif_gbps']:.2f} |")
    return "\n".join(lines)


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
    add("--block-kib", nargs="+", type=int, default=[4, 16, 64, 256, 1024, 4096],
        help="block sizes of the sweep, in KiB (default 4 16 64 256 1024 4096)")
    add("--read-mib", type=int, default=64, help="bytes of one READ in the sweep, in MiB (default 64)")
    add("--arch", nargs="*", choices=sorted(ARCHS), default=[],
        help="also time one request's read with these tiny architectures' KV cache configs (default: none)")
    add("--num-blocks", type=int, default=256, help="blocks per KV cache group in the --arch request (default 256)")
    add("--ucx-transports", default="auto", metavar="UCX_TLS",
        help="UCX transports, as pd serve's --kv-ucx-transports (default auto: sm,self,tcp on one host)")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="KV dtype of the --arch configs (default float32)")
    add("--repeats", type=int, default=10, help="timed repeats per figure; medians are reported (default 10)")
    add("--peer-poll-ms", type=float, default=1.0, help="how often P polls NIXL (its engine step)")
    add("--output", type=Path, default=Path("results/transfer.json"), help="where the JSON goes (default results/transfer.json)")
    args = p.parse_args(argv)
    if args.num_blocks < 4 or args.repeats < 1 or args.read_mib < 1 or min(args.block_kib) < 1:
        p.error("--num-blocks must be at least 4, --repeats, --read-mib and --block-kib at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    configure_ucx("127.0.0.1", args.ucx_transports)  # as a one-host deployment; spawned peers inherit it
    sweep = [bench_block_size(kib << 10, args) for kib in args.block_kib]
    print(f"One READ of {args.read_mib} MiB of scattered blocks between two processes, UCX_TLS="
          f"{os.environ.get('UCX_TLS')}; medians of {args.repeats} interleaved repeats; P polls every "
          f"{args.peer_poll_ms:g} ms (the notif column).")
    print(format_sweep(sweep))
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
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
