"""NIXL READs between tensor-parallel ranks of different sizes (real NIXL, P ranks in their
own processes on 127.0.0.1): each D rank reads from the P ranks holding its heads exactly
the bytes it lacks, one descriptor per block per (P rank, D rank) pair for attention
(and one more for a Mamba group split in two), never one per layer; its views then
read what a one-rank cache holds for its heads."""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import multiprocessing as mp
import time

import pytest

from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout
from connectors.nixl.peer_messages import HandshakeRequest, HandshakeResponse
from connectors.nixl.transport import NixlTransport
from connectors.nixl.ucx import configure_ucx
from tests.support.tp_caches import LAYERS, copy_pieces, expected_views, fill, rank_cache, views

pytestmark = pytest.mark.slow
BLOCKS = ([1, 2, 3], [5], [6, 8])  # per group; runs of blocks would merge between equal layouts
HASH = "tp-reads"
NUM_BLOCKS = 10


def p_main(conn, tp: int, rank: int) -> None:
    """P rank `rank` of `tp`: its share of the one-rank cache's bytes, the side channel."""
    configure_ucx("127.0.0.1", "auto")
    whole = rank_cache(1, 0, "canonical", NUM_BLOCKS)
    fill(whole[0], seed=0)
    mine = rank_cache(tp, rank, "canonical", NUM_BLOCKS)
    copy_pieces(whole, mine, [set(), set(), set()], BLOCKS)
    transport = NixlTransport(f"P{tp}-{rank}", mine[1])
    server = SideChannelServer("127.0.0.1", 0, lambda request: HandshakeResponse(
        transport.agent_metadata(), transport.local_layout(HASH)))
    try:
        conn.send(server.port)
        stop = time.monotonic() + 120
        while time.monotonic() < stop and not conn.poll(0.001):
            transport.get_notifs()
    finally:
        server.close()
        transport.close()


def start_prefill(tp: int) -> list:
    ctx = mp.get_context("spawn")
    peers = []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=p_main, args=(child, tp, rank), daemon=True)
        proc.start()
        peers.append((proc, parent))
    for proc, parent in peers:
        stop = time.monotonic() + 60
        while not parent.poll(0.1):
            assert proc.is_alive() and time.monotonic() < stop, "a P rank did not start"
    return [(proc, parent, parent.recv()) for proc, parent in peers]


def stop_prefill(peers: list) -> None:
    for proc, parent, _ in peers:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def wait(transport: NixlTransport, handle) -> str:
    stop = time.monotonic() + 10
    while (state := transport.poll(handle)) == "PROC" and time.monotonic() < stop:
        time.sleep(0.0005)
    return state


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])  # equal sizes: test_transport.py
def test_decode_ranks_read_their_heads_from_prefill_ranks(p_tp: int, d_tp: int) -> None:
    configure_ucx("127.0.0.1", "auto")
    whole = rank_cache(1, 0, "canonical", NUM_BLOCKS)
    fill(whole[0], seed=0)
    peers = start_prefill(p_tp)
    try:
        for d_rank in range(d_tp):
            decode = rank_cache(d_tp, d_rank, "canonical", NUM_BLOCKS)
            fill(decode[0], seed=50 + d_rank)  # stale bytes: the reads must replace exactly what it holds
            transport = NixlTransport(f"D{p_tp}x{d_tp}-{d_rank}", decode[1])
            taken = [set(), set(), set()]
            descriptors, moved = 0, 0
            try:
                for _, _, port in peers:
                    response = fetch_remote_layout("127.0.0.1", port, HandshakeRequest(transport.engine_id, HASH), 10.0)
                    peer = transport.add_peer(response, expected_compat_hash=HASH)
                    handle = transport.start_read(peer, [list(b) for b in BLOCKS], [list(b) for b in BLOCKS],
                                                  taken=taken)
                    assert wait(transport, handle) == "DONE", handle.error
                    descriptors += handle.num_descriptors
                    moved += handle.num_bytes
            finally:
                transport.close()
            for blocks, names in zip(BLOCKS, LAYERS.values()):
                for layer in names:
                    for got, want in zip(views(decode[0].layer_caches[layer]),
                                         expected_views(whole[0], d_tp, d_rank, layer)):
                        assert got[blocks].equal(want[blocks]), (layer, d_rank)
            data = [len(names) * g.spec.real_page_size_bytes for names, g in zip(LAYERS.values(),
                                                                                decode[0].config.groups)]
            if p_tp != d_tp:  # equal layouts move whole refs, padding included, runs of blocks merged
                assert moved == sum(len(b) * d for b, d in zip(BLOCKS, data)), "bytes read are the bytes it holds"
            p_ranks_per_d = max(1, p_tp // d_tp)
            mamba_split = d_tp > 2 or p_tp > 2  # more ranks than the two Mamba groups
            bound = sum(len(b) for b in BLOCKS) * p_ranks_per_d + (len(BLOCKS[2]) if mamba_split else 0)
            assert descriptors <= bound, (descriptors, bound)
    finally:
        stop_prefill(peers)
