"""NixlTransport: real NIXL READs between two processes on 127.0.0.1.

A spawned child is P: it owns a KV cache filled with a known pattern, serves the side
channel and polls NIXL, forwarding every notification it gets over a pipe. The test
process is D: handshake, add_peer, READ scattered block lists, then check that exactly
the right bytes landed (and nothing else moved), the descriptor counts, and that P got
the notification.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch

from connectors.nixl.descriptors import paired_runs
from connectors.nixl.handshake import HandshakeFailed, SideChannelServer, fetch_remote_layout
from connectors.nixl.peer_messages import (
    HandshakeError,
    HandshakeRequest,
    HandshakeResponse,
    ReadDone,
    Reject,
    decode_notif,
    encode_notif,
)
from connectors.nixl.transport import IncompatiblePeer, NixlTransport, TransferHandle, TransportError
from connectors.nixl.ucx import configure_ucx
from pd.kv_cache.allocation import KVCacheAllocation, allocate_kv_caches
from pd.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec, SlidingWindowSpec
from pd.kv_transfer.compat import compat_hash

pytestmark = pytest.mark.slow  # seconds per test of real sockets, servers and timeouts
NUM_BLOCKS = 64
P_SEED, D_SEED = 1, 2
DEADLINE_S = 10.0

# Per group (local ids on D, remote ids on P). Blocks of different groups are disjoint on
# each side. 0 = null: that position is skipped on both sides.
LOCAL = [[3, 4, 5, 0, 9, 10, 11, 12, 40], [0, 0, 20, 21, 22], [30]]
REMOTE = [[7, 8, 9, 0, 2, 3, 14, 15, 0], [5, 6, 40, 41, 43], [33]]
RUNS = [3, 2, 1]  # maximal runs where both sides go up by one, per group


def kv_config(partial_group: bool) -> KVCacheConfig:
    """Three groups (full attention, sliding window, Mamba) of 3 layers; with
    `partial_group` the sliding-window group has 2 (its canonical ref covers 2/3 of a row)."""
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")  # 512-byte page
    sliding = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="bfloat16", sliding_window=8)
    mamba = MambaSpec(block_size=4, num_heads=2, head_dim=4, state_size=8, n_groups=2, conv_width=3,
                      conv_dtype="bfloat16", ssm_dtype="float32", page_size_padded=512)
    sliding_layers = ("s0", "s1") if partial_group else ("s0", "s1", "s2")
    groups = (KVCacheGroup(full, ("f0", "f1", "f2")), KVCacheGroup(sliding, sliding_layers),
              KVCacheGroup(mamba, ("m0", "m1", "m2")))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, groups=groups)


def kv_hash(config: KVCacheConfig, layout: str) -> str:
    return compat_hash("tiny-test", "random", "none", "mixed", config.block_sizes, layout,
                       [repr(g.spec) for g in config.groups])


def filled(config: KVCacheConfig, layout: str, seed: int) -> KVCacheAllocation:
    alloc = allocate_kv_caches(config, "cpu", layout)
    gen = torch.Generator().manual_seed(seed)
    for buf in alloc.buffers:
        buf.copy_(torch.randint(-128, 128, buf.shape, generator=gen, dtype=torch.int8))
    return alloc


def p_main(conn, engine_id: str, layout: str, partial_group: bool) -> None:
    """P: serve the side channel, poll NIXL every ms, forward notifications, until told."""
    config = kv_config(partial_group)
    alloc = filled(config, layout, P_SEED)
    my_hash = kv_hash(config, layout)
    transport = NixlTransport(engine_id, alloc.describe(), block_sizes=config.block_sizes)

    def respond(request: HandshakeRequest):
        if request.compat_hash != my_hash:
            return HandshakeError(f"incompatible KV layout: peer {request.engine_id!r} differs from {engine_id!r}")
        return HandshakeResponse(transport.agent_metadata(), transport.local_layout(my_hash))

    server = SideChannelServer("127.0.0.1", 0, respond)
    try:
        conn.send(server.port)
        stop = time.monotonic() + 120  # never outlive a broken test
        while time.monotonic() < stop:
            if conn.poll(0.001):
                break  # any message (or EOF) means stop
            for peer, payloads in transport.get_notifs().items():
                for payload in payloads:
                    conn.send((peer, payload))
    finally:
        server.close()
        transport.close()


@dataclass
class PeerProcess:
    engine_id: str
    port: int
    process: mp.Process
    conn: object

    def notifs(self, count: int, deadline_s: float = DEADLINE_S) -> list[tuple[str, bytes]]:
        got, stop = [], time.monotonic() + deadline_s
        while len(got) < count and time.monotonic() < stop:
            if self.conn.poll(0.05):
                got.append(self.conn.recv())
        return got

    def drain(self) -> None:
        """Drop notifications an earlier test left behind."""
        while self.conn.poll(0):
            self.conn.recv()


def start_peer(engine_id: str, layout: str, partial_group: bool) -> PeerProcess:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=p_main, args=(child, engine_id, layout, partial_group), daemon=True)
    process.start()
    if not parent.poll(60):
        process.kill()
        process.join()
        raise RuntimeError("P did not start")
    return PeerProcess(engine_id, parent.recv(), process, parent)


def stop_peer(peer: PeerProcess) -> None:
    try:
        peer.conn.send("stop")
    except (BrokenPipeError, OSError):
        pass
    peer.process.join(10)
    if peer.process.is_alive():
        peer.process.kill()
        peer.process.join()


@dataclass
class Setup:
    layout: str
    partial_group: bool
    peer: PeerProcess
    d_alloc: KVCacheAllocation
    d: NixlTransport
    compat: str


CASES = [("canonical", False), ("per-layer", False), ("canonical", True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-partial' if c[1] else ''}")
def setup(request) -> Iterator[Setup]:
    layout, partial = request.param
    peer = start_peer(f"P-{layout}-{partial}", layout, partial)
    d = None
    try:
        config = kv_config(partial)
        d_alloc = filled(config, layout, D_SEED)
        d = NixlTransport(f"D-{layout}-{partial}", d_alloc.describe(),
                          block_sizes=config.block_sizes)
        yield Setup(layout, partial, peer, d_alloc, d, kv_hash(config, layout))
    finally:
        if d is not None:
            d.close()
        stop_peer(peer)


def handshake(s: Setup) -> str:
    s.peer.drain()
    return connect(s.d, s.peer, s.compat)


def connect(d: NixlTransport, peer: PeerProcess, compat: str) -> str:
    response = fetch_remote_layout("127.0.0.1", peer.port, HandshakeRequest(d.engine_id, compat), 5.0)
    return d.add_peer(response, expected_compat_hash=compat)


def wait(transport: NixlTransport, handle: TransferHandle) -> str:
    stop = time.monotonic() + DEADLINE_S
    while (state := transport.poll(handle)) == "PROC" and time.monotonic() < stop:
        time.sleep(0.0005)
    return state


def expected_after_read(s: Setup, before: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Oracle, per D buffer: its bytes after the read, and the bytes each position may hold
    instead. They differ only in the padding a run's range spans between the pages of a
    ref that covers part of a row (see block_ranges); there a copy of P's byte is fine."""
    source = filled(kv_config(s.partial_group), s.layout, P_SEED).buffers
    expected = [b.clone() for b in before]
    allowed = [b.clone() for b in before]
    caches = s.d_alloc.describe()
    for g, (lids, rids) in enumerate(zip(LOCAL, REMOTE)):
        pairs = [(lb, rb) for lb, rb in zip(lids, rids) if lb and rb]
        for ref in caches.group_data_refs[g]:
            t, start, end = ref.tensor_idx, ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes
            for i, (lb, rb) in enumerate(pairs):
                expected[t][lb, start:end] = allowed[t][lb, start:end] = source[t][rb, start:end]
                if i + 1 < len(pairs) and pairs[i + 1] == (lb + 1, rb + 1):  # inside a run
                    allowed[t][lb, end:] = source[t][rb, end:]
                    allowed[t][lb + 1, :start] = source[t][rb + 1, :start]
    return list(zip(expected, allowed))


def test_read_moves_exactly_the_paired_blocks_and_notifies(setup: Setup) -> None:
    s = setup
    assert handshake(s) == s.peer.engine_id
    before = [b.clone() for b in s.d_alloc.buffers]
    handle = s.d.start_read(s.peer.engine_id, LOCAL, REMOTE, encode_notif(ReadDone("req-1")))
    assert wait(s.d, handle) == "DONE", handle.error

    layers = [len(g.layer_names) for g in s.d_alloc.config.groups]
    per_run = layers if s.layout == "per-layer" else [1, 1, 1]
    assert handle.num_descriptors == sum(r * k for r, k in zip(RUNS, per_run))
    caches = s.d_alloc.describe()
    assert handle.num_bytes == sum(length for g, lids in enumerate(LOCAL)
                                   for _, length in _ranges(caches, g, lids, REMOTE[g]))

    for got, (want, also_ok) in zip(s.d_alloc.buffers, expected_after_read(s, before)):
        assert bool(((got == want) | (got == also_ok)).all())
    if not s.partial_group:  # every ref covers whole rows: the oracle is exact
        assert all(torch.equal(got, want) for got, (want, _) in zip(s.d_alloc.buffers, expected_after_read(s, before)))
    assert s.peer.notifs(1) == [(s.d.engine_id, encode_notif(ReadDone("req-1")))]


def _ranges(caches, group_id, local_ids, remote_ids):
    """Local (address, length) of each run of the pairing, through block_ranges."""
    out = []
    for start, _, n in paired_runs(local_ids, remote_ids):
        out += caches.block_ranges(group_id, range(start, start + n))
    return out


def test_read_of_only_null_positions_sends_the_notification_alone(setup: Setup) -> None:
    handshake(setup)
    before = [b.clone() for b in setup.d_alloc.buffers]
    handle = setup.d.start_read(setup.peer.engine_id, [[0, 5], [], [7]], [[4, 0], [], [0]],
                                encode_notif(ReadDone("empty")))
    assert (handle.state, handle.num_descriptors, handle.num_bytes) == ("DONE", 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(setup.d_alloc.buffers, before))
    assert setup.peer.notifs(1) == [(setup.d.engine_id, encode_notif(ReadDone("empty")))]


def test_send_notif_reaches_the_peer_and_add_peer_is_idempotent(setup: Setup) -> None:
    assert handshake(setup) == handshake(setup) == setup.peer.engine_id
    assert setup.d.peers == [setup.peer.engine_id]
    setup.d.send_notif(setup.peer.engine_id, encode_notif(Reject("req-2", "aborted")))
    (peer, payload), = setup.peer.notifs(1)
    assert peer == setup.d.engine_id and decode_notif(payload) == Reject("req-2", "aborted")


def test_bad_block_lists_raise_before_anything_moves(setup: Setup) -> None:
    handshake(setup)
    peer = setup.peer.engine_id
    with pytest.raises(ValueError, match="groups"):
        setup.d.start_read(peer, LOCAL[:2], REMOTE[:2])
    with pytest.raises(ValueError, match="group 1"):
        setup.d.start_read(peer, [[1], [2, 3], [4]], [[1], [2], [4]])
    with pytest.raises(ValueError, match="out of range"):
        setup.d.start_read(peer, [[1], [2], [NUM_BLOCKS]], [[1], [2], [4]])
    with pytest.raises(ValueError, match="unknown NIXL peer"):
        setup.d.start_read("nobody", LOCAL, REMOTE)


def test_incompatible_hash_is_refused_by_the_side_channel(setup: Setup) -> None:
    request = HandshakeRequest(setup.d.engine_id, kv_hash(kv_config(setup.partial_group), "other-layout"))
    with pytest.raises(HandshakeFailed, match="incompatible KV layout"):
        fetch_remote_layout("127.0.0.1", setup.peer.port, request, 5.0)


def test_add_peer_rejects_other_shapes_and_hashes(setup: Setup) -> None:
    layout = setup.d.local_layout(setup.compat)
    other = HandshakeResponse(b"not-metadata", layout)
    with pytest.raises(IncompatiblePeer, match="own id"):
        setup.d.add_peer(other)
    renamed = msgspec.structs.replace(layout, engine_id="X")
    with pytest.raises(IncompatiblePeer, match="incompatible KV layout: peer 'X' has hash"):
        setup.d.add_peer(HandshakeResponse(b"", renamed), expected_compat_hash="0" * 64)
    fewer = msgspec.structs.replace(renamed, group_data_refs=renamed.group_data_refs[:2], block_sizes=[4, 4],
                                    group_pieces=renamed.group_pieces[:2])
    with pytest.raises(IncompatiblePeer, match="2 KV cache groups, this engine 3"):
        setup.d.add_peer(HandshakeResponse(b"", fewer))
    refs = [list(r) for r in renamed.group_data_refs]
    refs[2][0] = msgspec.structs.replace(refs[2][0], page_size_bytes=refs[2][0].page_size_bytes // 2)
    with pytest.raises(IncompatiblePeer, match="group 2"):  # a layout that names no heads: pages must match
        setup.d.add_peer(HandshakeResponse(b"", msgspec.structs.replace(renamed, group_data_refs=refs,
                                                                        group_pieces=[])))
    assert "X" not in setup.d.peers


@pytest.fixture
def start_canonical_peer() -> Iterator:
    """Starts P processes on demand; stops every one it started."""
    started: list[PeerProcess] = []

    def start(engine_id: str) -> PeerProcess:
        started.append(start_peer(engine_id, "canonical", False))
        return started[-1]

    try:
        yield start
    finally:
        for peer in started:
            stop_peer(peer)


def test_read_from_a_dead_peer_fails_within_seconds_and_a_restarted_peer_works(start_canonical_peer) -> None:
    config = kv_config(False)
    compat = kv_hash(config, "canonical")
    d_alloc = filled(config, "canonical", D_SEED)
    d = NixlTransport("D-survivor", d_alloc.describe())
    try:
        peer = start_canonical_peer("P-mortal")
        connect(d, peer, compat)
        first = d.start_read(peer.engine_id, LOCAL, REMOTE, encode_notif(ReadDone("alive")))
        assert wait(d, first) == "DONE"  # connected and working before P dies
        peer.process.kill()
        peer.process.join()
        handle = d.start_read(peer.engine_id, LOCAL, REMOTE, encode_notif(ReadDone("dead")))
        assert wait(d, handle) == "ERR" and handle.error  # not still "PROC" at wait's deadline
        with pytest.raises(TransportError):
            d.send_notif(peer.engine_id, b"anyone?")
        assert d.get_notifs() == {}

        reborn = start_canonical_peer("P-mortal")  # same engine id, new agent metadata
        connect(d, reborn, compat)
        assert d.peers == ["P-mortal"]
        d_alloc.buffers[0].zero_()
        handle = d.start_read(reborn.engine_id, [[9, 10], [], []], [[2, 3], [], []], encode_notif(ReadDone("again")))
        assert wait(d, handle) == "DONE", handle.error
        source = filled(config, "canonical", P_SEED).buffers[0]
        assert torch.equal(d_alloc.buffers[0][9:11], source[2:4])
        assert reborn.notifs(1) == [("D-survivor", encode_notif(ReadDone("again")))]
    finally:
        d.close()


def test_device_kind_follows_the_tensors() -> None:
    caches = filled(kv_config(False), "canonical", D_SEED).describe()
    with pytest.raises(ValueError, match="does not match"):
        NixlTransport("D-vram?", caches, device_kind="VRAM")
    t = NixlTransport("D-dram", caches)
    try:
        assert t.device_kind == "DRAM" and t.local_layout("h").device_kind == "DRAM"
    finally:
        t.close()
        t.close()  # idempotent


UCX_NAMES = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MEM_EVENTS", "UCX_RCACHE_ENABLE", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
             "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")


@pytest.mark.parametrize("host, transports, env, expected", [
    ("127.0.0.1", "auto", {}, {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "lo"}),
    ("127.0.0.1", ("auto", True), {}, {"UCX_TLS": "sm,self,tcp,cuda_copy,cuda_ipc"}),  # a host with GPUs
    ("10.1.2.3", ("auto", True), {}, {"UCX_TLS": "^sm"}),  # between hosts: all but shared memory (CUDA IPC too)
    ("localhost", "auto", {"UCX_TLS": "tcp"}, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),  # the operator's wins
    ("10.1.2.3", "auto", {}, {"UCX_TLS": "^sm", "UCX_NET_DEVICES": None}),  # UCX's choice (rc, ud, tcp) less sm
    ("10.1.2.3", "auto", {}, {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}),  # GETs at TCP's speed
    ("10.1.2.3", "auto", {"UCX_TCP_TX_SEG_SIZE": "64k"}, {"UCX_TCP_TX_SEG_SIZE": "64k"}),
    ("127.0.0.1", "auto", {}, {"UCX_TCP_TX_SEG_SIZE": None}),  # TCP only wires one host's agents up
    ("10.1.2.3", "rc,ud,sm,self", {"UCX_TLS": "tcp"}, {"UCX_TLS": "rc,ud,sm,self", "UCX_NET_DEVICES": None}),
    ("127.0.0.1", "auto", {"UCX_NET_DEVICES": "eth1"}, {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "eth1"}),
    ("10.1.2.3", "auto", {}, {"UCX_MEM_EVENTS": "no", "UCX_RCACHE_ENABLE": "n"}),  # NIXL passes memory handles
    ("127.0.0.1", "auto", {"UCX_RCACHE_ENABLE": "y"}, {"UCX_MEM_EVENTS": "no", "UCX_RCACHE_ENABLE": "y"}),
    # KV on a GPU keeps UCX's cache and hooks (VRAM reads were 3.9x slower without them, H200)
    # and reads by CUDA IPC without NVLink too (UCX turns them off there)
    ("127.0.0.1", ("auto", True, True), {}, {"UCX_MEM_EVENTS": None, "UCX_RCACHE_ENABLE": None,
                                             "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}),
    ("10.1.2.3", ("auto", True, True), {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}),
    ("127.0.0.1", ("auto", True), {}, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": None}),  # KV in host memory
])
def test_configure_ucx_picks_transports_per_deployment(monkeypatch, host, transports, env, expected) -> None:
    for name in UCX_NAMES:  # set first: deleting a name that is not set records nothing to restore
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    configure_ucx(host, *(transports if isinstance(transports, tuple) else (transports,)))
    assert {name: os.environ.get(name) for name in expected} == expected


def test_kv_on_a_network_address_listens_on_its_interface_alone(monkeypatch) -> None:
    """UCX's TCP transport would listen on every interface, loopback included: narrowed
    to the one holding --kv-host (and the RDMA ports, none here)."""
    from connectors.nixl.ucx import interface_of, network_devices, rdma_ports

    assert interface_of("127.0.0.1") == "lo" and interface_of("::1") == "lo"
    assert interface_of("10.1.2.3") is None and interface_of("a-name") is None
    assert rdma_ports() == [] and network_devices("10.1.2.3") is None
    monkeypatch.setattr("connectors.nixl.ucx.interface_of", lambda host: "eth7")
    monkeypatch.setattr("connectors.nixl.ucx.rdma_ports", lambda: ["mlx5_0:1"])
    for name in UCX_NAMES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    configure_ucx("10.1.2.3")
    assert os.environ["UCX_NET_DEVICES"] == "eth7,mlx5_0:1"
