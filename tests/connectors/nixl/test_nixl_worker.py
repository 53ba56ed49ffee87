"""The NIXL connector's worker half: a D worker reads a request's blocks from a P worker
(two real NIXL agents, side channel on 127.0.0.1), P frees on the read-done notification,
on a reject, or when the lease expires; late and failed reads are reported as failures."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from connectors.nixl.scheduler import NixlConnectorMetadata, ReqToRecv, ReqToSend
from pd.kv_transfer.params import RemotePrefillParams
from tests.support.nixl_workers import CONFIG, Clock, Poller, make_worker, recv, remote_prefill

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def worker_pair(**p_config):
    """P (its blocks random bytes; `p_config`: more of its worker config) and D."""
    p, p_buf = make_worker("P", clock=Clock(), **p_config)
    d, d_buf = make_worker("D")
    p_buf.copy_(torch.randint(-128, 127, p_buf.shape, dtype=torch.int8))
    try:
        yield p, p_buf, d, d_buf
    finally:
        d.shutdown()
        p.shutdown()


@pytest.fixture
def pair():
    with worker_pair() as workers:
        yield workers


def test_d_reads_the_blocks_and_p_frees_on_the_notification(pair) -> None:
    p, p_buf, d, d_buf = pair
    before = d_buf.clone()
    p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend("p1", deadline=p.config.clock() + 60)]))
    local, remote = [[0, 5, 6, 9], [0, 0, 11, 0]], [[3, 4, 5, 8], [0, 0, 7, 0]]
    d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[recv(p, local, remote)]))
    poller = Poller(p, d)
    poller.until(lambda x: x.recved["D"] and x.sent["P"])
    assert poller.recved["D"] == {"d1"} and poller.sent["P"] == {"p1"}
    for local_ids, remote_ids in zip(local, remote):
        for lb, rb in zip(local_ids, remote_ids):
            if lb:
                page = CONFIG.page_size_bytes * 2  # two layers per group: one contiguous range
                assert torch.equal(d_buf[lb, :page], p_buf[rb, :page])
    touched = {5, 6, 9, 11}
    untouched = [b for b in range(CONFIG.num_blocks) if b not in touched]
    assert torch.equal(d_buf[untouched], before[untouched])
    assert d.stats.reads == 1 and d.stats.read_descriptors == 3  # runs: (5,6) (9) in group 0, (11) in group 1
    assert d.stats.read_bytes == 4 * 2 * CONFIG.page_size_bytes


def test_a_reject_frees_at_once_and_a_lease_expiry_frees_later(pair) -> None:
    p, _, d, _ = pair
    p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend("p1", p.config.clock() + 60),
                                                        ReqToSend("p2", p.config.clock() + 60)]))
    d.start_load_kv(NixlConnectorMetadata(reqs_to_reject=[(remote_prefill("P", "127.0.0.1", p.side_channel_port, "p1"),
                                                          "aborted")]))
    poller = Poller(p, d)
    poller.until(lambda x: x.sent["P"])
    assert poller.sent["P"] == {"p1"} and p.num_requests_held == 1
    p.config.clock.now += 61
    assert p.get_finished(set()).finished_sending == {"p2"} and p.stats.leases_expired == 1


@pytest.mark.parametrize("notif", ["reject", "keep-alive"])
def test_a_notification_to_a_new_peer_arrives_though_d_has_nothing_else_to_poll(pair, notif) -> None:
    """Without a progress thread, UCX delivers a notification (and wires up a new peer's
    endpoint) only while the sender polls: D, with nothing else under way, must keep
    polling for a while after it sent one, or P never hears of it."""
    p, _, d, _ = pair
    p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend("p1", p.config.clock() + 60)]))
    remote = remote_prefill("P", "127.0.0.1", p.side_channel_port, "p1")
    d.start_load_kv(NixlConnectorMetadata(reqs_to_reject=[(remote, "aborted")]) if notif == "reject"
                    else NixlConnectorMetadata(reqs_to_keep_alive=[remote]))
    Poller(p, d, as_engines=True).until(lambda x: p.stats.rejects_received + p.stats.keep_alives_received == 1)
    assert p.num_requests_held == (notif == "keep-alive")


def test_a_release_frees_at_once_and_only_what_is_held(pair) -> None:
    p, _, _, _ = pair
    p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend("p1", p.config.clock() + 60),
                                                        ReqToSend("p2", p.config.clock() + 60)]))
    p.start_load_kv(NixlConnectorMetadata(reqs_to_release=["p1", "unknown"]))
    assert p.get_finished(set()).finished_sending == {"p1"}
    assert p.num_requests_held == 1 and p.stats.released == 1
    assert p.get_finished(set()).finished_sending == set()  # reported once


def test_a_keep_alive_extends_the_lease_from_its_arrival(pair) -> None:
    p, _, d, _ = pair
    p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend("p1", p.config.clock() + 60)]))
    p.config.clock.now += 30  # half the lease has passed when the KeepAlive arrives
    d.start_load_kv(NixlConnectorMetadata(reqs_to_keep_alive=[remote_prefill("P", "127.0.0.1", p.side_channel_port,
                                                                            "p1")]))
    Poller(p, d).until(lambda x: p.stats.keep_alives_received == 1)
    p.config.clock.now += 31  # past the first lease: the KeepAlive moved its end to arrival + 60
    assert p.get_finished(set()).finished_sending == set() and p.num_requests_held == 1
    p.config.clock.now += 30
    assert p.get_finished(set()).finished_sending == {"p1"} and p.stats.leases_expired == 1


def test_a_read_ending_after_the_lease_is_a_failure(pair) -> None:
    p, _, d, _ = pair
    d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[recv(p, [[1], [2]], [[3], [4]], lease=time.time() - 1)]))
    poller = Poller(p, d)
    poller.until(lambda x: x.failed["D"])
    assert poller.failed["D"] == {"d1"} and d.stats.failures == 1


def test_an_incompatible_peer_or_unreachable_p_fails_the_request_only(pair) -> None:
    p, _, _, _ = pair
    other, _ = make_worker("D2", compat="other-model", handshake_timeout_s=1.0)  # (port 1: fails at the timeout)
    try:
        other.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[recv(p, [[1], [2]], [[3], [4]])]))
        Poller(other).until(lambda x: x.failed["D2"] == {"d1"})  # the handshake ran off the step
        gone = ReqToRecv("d2", remote_prefill("P9", "127.0.0.1", 1, "p9"), [[1], [2]], [[3], [4]])
        other.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[gone]))
        Poller(other).until(lambda x: x.failed["D2"] == {"d2"})
        # a peer that just failed is not tried again: the next request naming it fails at once
        again = ReqToRecv("d3", remote_prefill("P9", "127.0.0.1", 1, "p9"), [[1], [2]], [[3], [4]])
        other.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[again]))
        assert other.get_finished(set()).failed_recving.keys() == {"d3"} and other.peers.handshakes.num_pending == 0
    finally:
        other.shutdown()


TIMEOUT_SCENARIO = """
import time
import torch
import dataclasses
from tests.support.nixl_workers import Clock, Poller, make_worker, recv
from connectors.nixl.scheduler import NixlConnectorMetadata, ReqToSend

p, p_buf = make_worker("P")
clock = Clock()
d, d_buf = make_worker("D", clock=clock)
d.config = dataclasses.replace(d.config, transfer=dataclasses.replace(d.config.transfer, read_timeout_s=5.0))
p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend("p1", deadline=time.monotonic() + 600)]))
d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[recv(p, [list(range(1, 31)), [0] * 30],
                                                            [list(range(1, 31)), [0] * 30])]))
Poller(p, d).until(lambda _: "P" in d.peers)
d.get_finished(set())  # posts the READ; over tcp it moves only while P progresses, and P is not polled now
assert len(d.loading) == 1, "the read should still be under way"
clock.now += 4.0
assert not d.get_finished(set()).failed_recving and len(d.loading) == 1
clock.now += 1.0
out = d.get_finished(set())
assert set(out.failed_recving) == {"d1"} and "still under way after 5 s" in out.failed_recving["d1"], out
assert not d.loading and d.stats.failures == 1
poller = Poller(p, d)
poller.until(lambda x: x.sent["P"])  # D's reject reaches P: the blocks are freed at once
assert poller.sent["P"] == {"p1"} and p.stats.rejects_received == 1
d.shutdown()
p.shutdown()
print("OK")
"""


def test_a_read_still_under_way_after_the_timeout_is_cancelled_and_fails() -> None:
    """On one host a READ is one CMA copy and ends inside its post; over TCP it moves only
    while P's agent progresses. With P not polled, D's read stays in progress: after
    `read_timeout_s` D cancels it, reports it failed and tells P to free (in a child
    process, as UCX_TLS is read once per process)."""
    env = {**os.environ, "UCX_TLS": "tcp,self", "NIXL_LOG_LEVEL": "ERROR"}
    done = subprocess.run([sys.executable, "-c", TIMEOUT_SCENARIO], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


def held(p, request_id: str = "p1") -> RemotePrefillParams:
    """P keeps blocks for `request_id` (a lease slot and a lease); where D finds them."""
    slot, token = p.leases.hold(request_id)
    p.start_load_kv(NixlConnectorMetadata(reqs_to_send=[ReqToSend(request_id, p.config.clock() + 60)]))
    return remote_prefill("P", "127.0.0.1", p.side_channel_port, request_id, lease_slot=slot, lease_token=token)


@pytest.mark.parametrize("trusted", [True, False])
def test_d_checks_p_s_lease_word_after_its_read_then_p_frees(pair, trusted) -> None:
    p, p_buf, d, d_buf = pair
    remote = held(p)
    d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[ReqToRecv("d1", remote, [[5, 6], [0, 7]], [[3, 4], [0, 9]],
                                                                  trusted=trusted)]))
    poller = Poller(p, d)
    poller.until(lambda x: x.recved["D"] and x.sent["P"])
    assert torch.equal(d_buf[[5, 6, 7]], p_buf[[3, 4, 9]])
    assert p.num_requests_held == 0 and p.leases.num_held == 0
    assert int(p.leases.words[remote.lease_slot]) == 0  # freed: a later reader sees the slot changed
    assert d.stats.reads == 1 and d.stats.failures == 0
    assert poller.unverified["D"] == (set() if trusted else {"d1"})  # unsigned: not for the prefix cache


def test_blocks_p_freed_before_the_read_ended_fail_the_read(pair) -> None:
    """Issue 31 row 3: P released the request (its slot now reads 0) and may reuse the
    blocks: whatever D read from them is not the request's KV."""
    p, _, d, _ = pair
    remote = held(p)
    p.start_load_kv(NixlConnectorMetadata(reqs_to_release=["p1"]))
    assert p.get_finished(set()).finished_sending == {"p1"}
    d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[ReqToRecv("d1", remote, [[5], [0]], [[3], [0]],
                                                                  trusted=True)]))
    poller = Poller(p, d)
    poller.until(lambda x: x.failed["D"])
    assert poller.recved["D"] == set() and d.stats.failures == 1 and d.stats.reads == 0


@pytest.fixture
def digesting_pair():
    with worker_pair(digest=True) as workers:
        yield workers


def digested(p, block_ids: list[list[int]]) -> RemotePrefillParams:
    """P held `p1` and digested its blocks in the step that computed them; its parameters."""
    p.start_load_kv(NixlConnectorMetadata(reqs_to_digest=[("p1", block_ids)]))
    p.get_finished(set())
    params = held(p)
    digests = p.digest_book.take("p1")
    assert digests is not None and len(digests) == 1
    return msgspec.structs.replace(params, remote_block_ids=block_ids, kv_digests=digests)


def test_every_byte_read_is_checked_against_the_holders_digests(digesting_pair) -> None:
    p, p_buf, d, d_buf = digesting_pair
    remote = digested(p, [[3, 4, 0], [0, 9, 0]])
    d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[ReqToRecv("d1", remote, [[5, 6, 0], [0, 7, 0]],
                                                                  remote.remote_block_ids, trusted=True)]))
    poller = Poller(p, d)
    poller.until(lambda x: x.recved["D"] and x.sent["P"])
    assert d.stats.digests_checked == 1 and d.stats.digest_mismatches == 0 and d.stats.failures == 0


@pytest.mark.parametrize("where", ["read", "held here already"])
def test_a_bit_flipped_in_p_s_kv_after_the_prefill_fails_the_read_if_it_was_read(digesting_pair, where) -> None:
    """The KV P holds changes between its prefill (digested) and D's read: D finds out,
    tells P to free the blocks, and fails the load (the scheduler recomputes it). A block
    D does not read (its own prefix-cache hit) is not D's to check."""
    p, p_buf, d, d_buf = digesting_pair
    remote = digested(p, [[3, 4], [0, 9]])
    p_buf[4 if where == "read" else 3, 17] ^= 0x10
    local = [[5, 6], [0, 7]] if where == "read" else [[0, 6], [0, 7]]
    d.start_load_kv(NixlConnectorMetadata(reqs_to_recv=[ReqToRecv("d1", remote, local, remote.remote_block_ids,
                                                                  trusted=True)]))
    poller = Poller(p, d)
    if where != "read":
        poller.until(lambda x: x.recved["D"] and x.sent["P"])
        assert d.stats.digests_checked == 1 and d.stats.digest_mismatches == 0
        return
    poller.until(lambda x: x.failed["D"] and x.sent["P"])  # P frees on D's reject
    assert poller.recved["D"] == set() and d.stats.digest_mismatches == 1 and d.stats.digests_checked == 0
    assert p.num_requests_held == 0
