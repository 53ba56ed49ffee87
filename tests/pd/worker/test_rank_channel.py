"""The engine ↔ rank channel: every message survives the trip as its schema says, anything
else is a ChannelError (never a crash, never a pickle), and a rank joins from another
node only when both ends hold the deployment's secret."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest

from connectors.nixl.scheduler import NixlConnectorMetadata, ReqToRecv, ReqToSend
from pd.config import EngineConfig
from pd.contracts.connector_api import ConnectorContext, KVConnectorOutput
from pd.contracts.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pd.contracts.sampling_params import SamplingParams
from pd.worker import rank_join
from pd.worker.rank_channel import (
    ENCODER,
    FROM_RANK,
    HEADER,
    TO_RANK,
    Challenge,
    ChannelError,
    Hello,
    RankChannel,
    Refused,
    Step,
    StepDone,
    StoreAddress,
    decode,
    encode,
    mac,
    new_nonce,
)
from pd.worker.rank_join import RankListener, join
from pd.worker.tp_ranks import rank_setup
from tests.support.nixl_workers import remote_prefill
from tests.support.server_harness import wait_until

SECRET = "s" * 64


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ours, theirs = RankChannel(a), RankChannel(b)
    yield ours, theirs
    ours.close()
    theirs.close()


def a_step() -> SchedulerOutput:
    remote = remote_prefill("pd-p", "127.0.0.1", 5555, "r0", lease_expires_at=1e9, lease_slot=3, lease_token=99)
    metadata = NixlConnectorMetadata(reqs_to_recv=[ReqToRecv("a", remote, [[3, 4]], [[1, 2]], trusted=True)],
                                     reqs_to_send=[ReqToSend("b", 12.5)], reqs_to_release=["c"])
    return SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], 3, SamplingParams(max_tokens=4, seed=7), [[3, 4]], 0)],
        cached_requests=[CachedRequestData("b", [[9]], 17)], num_scheduled_tokens={"a": 3, "b": 1},
        finished_req_ids={"z"}, kv_connector_metadata=metadata, block_copies=[(1, 2)],
        grammar_masks={"a": np.array([-1, 5, 0], dtype=np.int32)})


def test_a_step_crosses_whole_with_its_connector_metadata(pair) -> None:
    ours, theirs = pair
    step = a_step()
    ours.send(Step(replace(step, kv_connector_metadata=None), encode(step.kv_connector_metadata)))
    got = theirs.recv(TO_RANK, timeout=5)
    got.output.kv_connector_metadata = decode(got.metadata, NixlConnectorMetadata)
    masks = got.output.grammar_masks
    assert masks["a"].tolist() == [-1, 5, 0] and masks["a"].dtype == np.int32
    assert replace(got.output, grammar_masks={}) == replace(step, grammar_masks={})


def test_a_rank_is_set_up_without_the_secret(pair, tiny_models) -> None:
    config = EngineConfig.from_flat(model=tiny_models["qwen3"], dtype="float32", kv_connector="nixl",
                                    kv_transfer_secret=SECRET, tensor_parallel_size=2, tp_local_ranks=1,
                                    tp_port=1234).resolve()
    context = ConnectorContext("pd-e", config.transfer.connector_config(), "h" * 64, [16], tp_size=2)
    setup = rank_setup(config, 1, StoreAddress(host="127.0.0.1", port=5), context, remote=True)
    assert SECRET.encode() not in ENCODER.encode(setup)
    ours, theirs = pair
    ours.send(setup)
    got = theirs.recv(TO_RANK, timeout=5)
    assert got.config.model.path == Path(tiny_models["qwen3"]) and got.config.transfer.secret is None
    assert (got.config.parallel.local_ranks, got.config.model.device, got.rank, got.context.rank) == (1, "cpu", 1, 1)
    assert got.store == StoreAddress(host="127.0.0.1", port=5)


def test_a_rank_reports_its_step(pair) -> None:
    ours, theirs = pair
    theirs.send(StepDone(KVConnectorOutput(finished_recving={"a"}, load_sizes={"a": (4096, 2)})))
    assert ours.recv(FROM_RANK, timeout=5).output.load_sizes == {"a": (4096, 2)}


@pytest.mark.parametrize("frame", [
    b"\x00\x00\x00\x03abc",  # not msgpack
    HEADER.pack(2) + b"\x81\xa1",  # cut
    HEADER.pack(8) + msgspec.msgpack.encode({"type": "step", "output": 1, "metadata": 2})[:8],
    HEADER.pack(1 << 31),  # over the frame limit
])
def test_anything_else_is_a_channel_error(pair, frame: bytes) -> None:
    ours, theirs = pair
    ours.sock.sendall(frame)
    ours.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ChannelError):
        theirs.recv(TO_RANK, timeout=5)


def test_an_array_a_step_does_not_carry_is_refused(pair) -> None:
    ours, theirs = pair
    step = replace(a_step(), kv_connector_metadata=None, grammar_masks={"a": np.zeros(3, dtype=np.float64)})
    ours.send(Step(step, encode(None)))
    with pytest.raises(ChannelError, match="not one a step carries"):
        theirs.recv(TO_RANK, timeout=5)


def test_silence_times_out(pair) -> None:
    with pytest.raises(ChannelError, match="timed out"):
        pair[1].recv(TO_RANK, timeout=0.2)


# ---- joining from another node -------------------------------------------------------


@pytest.fixture
def listener():
    awaiting = RankListener("127.0.0.1", 0, SECRET, {2, 3})
    yield awaiting
    awaiting.close()


def test_ranks_join_once_each_with_the_secret(listener) -> None:
    two = join("127.0.0.1", listener.port, 2, SECRET, timeout=5)
    with pytest.raises(ChannelError, match="refused rank 2"):
        join("127.0.0.1", listener.port, 2, SECRET, timeout=5)  # already joined
    with pytest.raises(ChannelError, match="refused rank 7"):
        join("127.0.0.1", listener.port, 7, SECRET, timeout=5)  # not one of its ranks
    three = join("127.0.0.1", listener.port, 3, SECRET, timeout=5)
    joined = listener.wait(5, lambda: None)
    assert sorted(joined) == [2, 3] and wait_until(lambda: listener.refused == 2)  # counted as the refusal is sent
    joined[2].send(Challenge(b"x"))  # the joined channels carry messages both ways
    assert two.recv(rank_join.JOIN_FROM_ENGINE, timeout=5) == Challenge(b"x")
    two.close()
    three.close()


def test_a_wrong_secret_is_refused_both_ways(listener) -> None:
    with pytest.raises(ChannelError, match="refused rank 2"):
        join("127.0.0.1", listener.port, 2, "not the secret", timeout=5)
    assert wait_until(lambda: listener.refused == 1)
    impostor = RankListener("127.0.0.1", 0, "another deployment", {2})
    try:
        with pytest.raises(ChannelError):
            join("127.0.0.1", impostor.port, 2, SECRET, timeout=5)
    finally:
        impostor.close()
    assert not listener.joined


def test_a_silent_or_garbled_connection_does_not_hold_up_the_ranks(listener) -> None:
    silent = socket.create_connection(("127.0.0.1", listener.port))
    with socket.create_connection(("127.0.0.1", listener.port)) as garbled:
        garbled.sendall(HEADER.pack(100_000) + b"\xff" * 64)  # over the joining frame limit
        start = time.monotonic()
        channels = [join("127.0.0.1", listener.port, rank, SECRET, timeout=5) for rank in (2, 3)]
        assert sorted(listener.wait(5, lambda: None)) == [2, 3]
        assert time.monotonic() - start < rank_join.JOIN_TIMEOUT_S / 2
    assert wait_until(lambda: listener.refused >= 1)
    silent.close()
    for channel in channels:
        channel.close()


def test_a_hello_replayed_from_another_challenge_is_refused(listener) -> None:
    """A hello is bound to the engine's nonce: one recorded from an earlier join fails."""
    with socket.create_connection(("127.0.0.1", listener.port)) as raw:
        channel = RankChannel(raw, 4096)
        channel.recv(rank_join.JOIN_FROM_ENGINE, timeout=5)
        stale = mac(SECRET, rank_join.RANK_ROLE, new_nonce(), 2)
        channel.send(Hello(2, new_nonce(), stale))
        assert channel.recv(rank_join.JOIN_FROM_ENGINE, timeout=5) == Refused(
            "it does not hold the deployment's secret")
        with pytest.raises(ChannelError, match="ended"):
            channel.recv(rank_join.JOIN_FROM_ENGINE, timeout=5)
    assert not listener.joined


def test_idle_connections_cannot_keep_a_rank_out(listener) -> None:
    """More silent connections from the rank's own address than the listener hears out
    at once (the probe's 16 locked a rank out for good): each newer one closes the
    oldest silent one, so the rank's own connection is heard, and it joins."""
    idle = [socket.create_connection(("127.0.0.1", listener.port))
            for _ in range(3 * rank_join.MAX_PENDING_PER_ADDRESS)]
    try:
        channel = join("127.0.0.1", listener.port, 2, SECRET, timeout=30)
        assert wait_until(lambda: sorted(listener.joined) == [2])  # entered as the welcome is sent
        assert wait_until(lambda: listener.refused >= len(idle) - rank_join.MAX_PENDING_PER_ADDRESS)
        assert len(listener.proving) <= rank_join.MAX_PENDING_PER_ADDRESS
        channel.close()
    finally:
        for sock in idle:
            sock.close()


def test_a_rank_dropped_before_its_welcome_tries_again_and_then_says_what_it_met() -> None:
    """A connection the engine closes without a refusal (dropped for a newer one, a
    listener not yet the engine's) is tried again until the join timeout."""
    with socket.create_server(("127.0.0.1", 0)) as closing:
        port = closing.getsockname()[1]
        accepted = []

        def close_each() -> None:
            while len(accepted) < 3:
                conn, _ = closing.accept()
                accepted.append(conn)
                conn.close()

        threading.Thread(target=close_each, daemon=True).start()
        with pytest.raises(ChannelError, match=r"could not join .* the last try: the connection failed before a "
                                               r"welcome: the connection ended"):
            join("127.0.0.1", port, 2, SECRET, timeout=2 * rank_join.RETRY_S)
        assert len(accepted) >= 2  # tried again


def test_a_refused_hello_is_not_tried_again(listener) -> None:
    with pytest.raises(ChannelError, match="refused rank 2: it does not hold the deployment's secret"):
        join("127.0.0.1", listener.port, 2, "not the secret", timeout=60)
    assert wait_until(lambda: listener.refused == 1)
    assert listener.refused == 1 and not listener.joined


def test_waiting_gives_up_with_the_ranks_missing(listener) -> None:
    with pytest.raises(RuntimeError, match=r"ranks \[2, 3\] did not join"):
        listener.wait(0.2, lambda: None)


def test_the_channel_reads_frames_split_across_sends(pair) -> None:
    ours, theirs = pair
    frame = ENCODER.encode(StepDone(KVConnectorOutput(finished_sending={"q"})))
    whole = HEADER.pack(len(frame)) + frame
    sender = threading.Thread(target=lambda: [ours.sock.sendall(whole[i:i + 3]) or time.sleep(0.001)
                                              for i in range(0, len(whole), 3)])
    sender.start()
    assert theirs.recv(FROM_RANK, timeout=5).output.finished_sending == {"q"}
    sender.join()
