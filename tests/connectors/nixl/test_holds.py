"""P's held requests (connectors/nixl/holds.py), without NIXL: each ends once — on D's
read-done or Reject, a release from the scheduler half, or its lease's end — and its
lease word reads 0 from then on; a KeepAlive extends the lease from its arrival."""

from __future__ import annotations

import pytest

from connectors.nixl.holds import LATE_READ_GRACE_S, Answered, Holds
from connectors.nixl.leases import LeaseTable
from connectors.nixl.peer_messages import KeepAlive, ReadDone, Reject, encode_notif
from connectors.nixl.stats import TransferStats
from pd.contracts.connector_api import KVConnectorOutput


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def held():
    clock, polls = Clock(), []
    holds = Holds(lease_seconds=30.0, clock=clock, stats=TransferStats(), poll_for=polls.append)
    holds.leases = LeaseTable(4)
    slots = {}
    for req_id in ("a", "b"):
        slots[req_id] = holds.leases.hold(req_id)[0]
        holds.hold(req_id, deadline=clock.now + 10)
    return holds, clock, polls, slots


def step(holds: Holds, *notifs) -> set[str]:
    output = KVConnectorOutput()
    holds.update({"D": [n if isinstance(n, bytes) else encode_notif(n) for n in notifs]}, output)
    return output.finished_sending


def test_read_done_and_reject_end_a_hold_once_and_zero_its_word(held) -> None:
    holds, _, _, slots = held
    assert step(holds, ReadDone("a"), Reject("b", "no room"), ReadDone("a"), ReadDone("unknown")) == {"a", "b"}
    assert len(holds) == 0 and holds.leases.words[slots["a"]] == 0 and holds.leases.words[slots["b"]] == 0
    assert holds.stats.rejects_received == 1
    assert step(holds, ReadDone("a")) == set()


def test_a_keep_alive_extends_the_lease_from_its_arrival(held) -> None:
    holds, clock, polls, slots = held
    clock.now += 5
    assert step(holds, KeepAlive("a")) == set()
    clock.now += 10  # past b's deadline, within a's extended one
    assert step(holds) == {"b"} and polls == [LATE_READ_GRACE_S]
    assert len(holds) == 1 and holds.leases.words[slots["a"]] != 0
    clock.now += 30
    assert step(holds) == {"a"} and holds.stats.leases_expired == 2


def test_a_release_is_reported_at_the_next_update(held) -> None:
    holds, _, _, slots = held
    holds.release("a")
    holds.release("nothing held")
    assert holds.leases.words[slots["a"]] == 0 and holds.stats.released == 1
    assert step(holds) == {"a"} and step(holds) == set()


def test_malformed_notifications_are_counted_and_ignored(held) -> None:
    holds, *_ = held
    assert step(holds, b"\x00garbage", b"", ReadDone("a")) == {"a"}
    assert holds.stats.malformed_notifications == 2 and len(holds) == 1


def test_notifications_from_an_agent_never_answered_end_and_extend_nothing(held) -> None:
    """A host that reached this agent without a handshake (not a peer) cannot free or keep
    another reader's blocks."""
    holds, clock, _, _ = held
    holds.peers = Answered()
    holds.peers.note("D")
    output = KVConnectorOutput()
    holds.update({"stranger": [encode_notif(ReadDone("a")), encode_notif(KeepAlive("b"))]}, output)
    assert output.finished_sending == set() and len(holds) == 2
    assert holds.stats.stranger_notifications == 2 and holds.deadlines["b"] == clock.now + 10
    assert step(holds, ReadDone("a")) == {"a"}  # from the peer answered


def test_the_agents_answered_forget_the_one_heard_from_least_recently() -> None:
    answered = Answered(limit=2)
    for agent in ("old", "busy", "new"):
        answered.note(agent)
        if agent == "busy":
            answered.note("old")  # heard from again: "busy" is now the least recent
    assert "old" in answered and "new" in answered and "busy" not in answered


def test_a_notification_keeps_its_agent_answered(held) -> None:
    holds, *_ = held
    holds.peers = Answered(limit=2)
    for agent in ("D", "E"):
        holds.peers.note(agent)
    step(holds, ReadDone("a"))  # from D: now heard from more recently than E
    holds.peers.note("F")
    assert "D" in holds.peers and "E" not in holds.peers
