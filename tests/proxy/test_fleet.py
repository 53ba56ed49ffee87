"""The fleet's membership (proxy/fleet.py): add, drain, remove after the drain, roles,
registration and its lease, with a clock of the test's."""

from __future__ import annotations

import pytest

from proxy.fleet import FLEET_ALLOW, Fleet, FleetError, allowed_networks, instance_url
from proxy.instances import Instance, InstancePool, Route
from wire.fleet import FRESH_S, Registration

P, D, BOTH = "http://127.0.0.1:8101", "http://127.0.0.1:8201", "http://127.0.0.1:8301"
NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_fleet(prefill=(), decode=()) -> tuple[Fleet, list, Clock]:
    clock, joined = Clock(), []
    fleet = Fleet({"prefill": InstancePool.of(prefill, "prefill", "round_robin"),
                   "decode": InstancePool.of(decode, "decode", "round_robin")},
                  lambda url, role: Instance(url, role), allowed_networks(FLEET_ALLOW), clock=clock,
                  on_join=lambda i: joined.append(("join", i.url, i.role)),
                  on_leave=lambda i: joined.append(("leave", i.url, i.role)))
    return fleet, joined, clock


def registration(url=BOTH, roles=("prefill", "decode"), role="decode", sent_at=NOW, **extra) -> Registration:
    return Registration(url=url, roles=list(roles), role=role, sent_at=sent_at, **extra)


def test_an_added_instance_is_routed_to_and_a_drained_one_is_not() -> None:
    fleet, joined, _ = make_fleet(prefill=[P])
    decode = fleet.add(D + "/", "decode")
    assert decode.url == D and fleet.pools["decode"].pick(Route("k")) is decode
    assert joined == [("join", D, "decode")]
    fleet.drain(D)
    with pytest.raises(Exception, match="no healthy decode instance"):
        fleet.pools["decode"].pick(Route("k"))
    fleet.drain(D, draining=False)
    assert fleet.pools["decode"].pick(Route("k")) is decode
    assert [c.action for c in fleet.changes] == ["joined", "drained", "undrained"]


def test_removal_waits_for_what_is_in_flight_and_never_cuts_it() -> None:
    fleet, joined, _ = make_fleet(prefill=[P], decode=[D])
    instance = fleet.get(D)
    instance.outstanding = 2
    assert fleet.remove(D) is False
    assert instance.draining and fleet.find(D) is instance  # still there: requests in flight
    fleet.tick()
    assert fleet.find(D) is instance
    with pytest.raises(FleetError, match="being removed"):
        fleet.drain(D, draining=False)
    instance.outstanding = 0
    fleet.tick()
    assert fleet.find(D) is None and joined == [("leave", D, "decode")]
    assert fleet.remove(P, force=True) is True and fleet.find(P) is None


def test_a_role_switch_moves_a_both_server_and_a_fixed_one_refuses() -> None:
    fleet, joined, _ = make_fleet(prefill=[P])
    both = fleet.add(BOTH, "decode", ("prefill", "decode"))
    both.outstanding = 1  # a request in flight keeps its instance
    assert fleet.set_role(BOTH, "prefill") is both
    assert both.role == "prefill" and both in fleet.pools["prefill"].instances
    assert both not in fleet.pools["decode"].instances and both.outstanding == 1
    assert joined[-2:] == [("leave", BOTH, "decode"), ("join", BOTH, "prefill")]
    with pytest.raises(FleetError, match="serves only as prefill") as refused:
        fleet.set_role(P, "decode")
    assert refused.value.status == 409


@pytest.mark.parametrize(("url", "status"), [
    ("http://127.0.0.1", 400), ("ftp://127.0.0.1:1", 400), ("http://127.0.0.1:1/v1", 400), ("nonsense", 400),
    ("http://127.0.0.1:99999", 400), ("http://10.0.0.1:8000", 403), ("http://example.com:8000", 403),
    ("http://[::1]:8000", None), ("http://127.0.0.2:8000/", None)])
def test_an_instance_url_is_a_base_url_in_the_allowed_networks(url, status) -> None:
    networks = allowed_networks(FLEET_ALLOW)
    if status is None:
        assert instance_url(url, networks) == url.rstrip("/")
    else:
        with pytest.raises(FleetError) as refused:
            instance_url(url, networks)
        assert refused.value.status == status


def test_a_registration_joins_renews_and_ends_with_its_lease() -> None:
    fleet, joined, clock = make_fleet()
    instance = fleet.register(registration(lease_s=10, compat_hash="abc", tp=2), NOW)
    assert (instance.role, instance.roles, instance.source) == ("decode", ("prefill", "decode"), "registered")
    assert instance.info["tp"] == 2
    clock.t += 9
    fleet.register(registration(sent_at=NOW + 9, lease_s=10), NOW + 9)  # renewed
    clock.t += 9
    fleet.tick()
    assert fleet.find(BOTH) is instance
    clock.t += 1.5
    fleet.tick()
    assert fleet.find(BOTH) is None and fleet.changes[-1].action == "expired"
    assert fleet.register(registration(sent_at=NOW + 20), NOW + 20).url == BOTH  # back by itself


def test_a_registration_is_refused_when_stale_played_back_or_incompatible() -> None:
    fleet, _, _ = make_fleet()
    fleet.register(registration(sent_at=NOW, compat_hash="abc"), NOW)
    with pytest.raises(FleetError, match="older than one taken"):
        fleet.register(registration(sent_at=NOW, state="serving"), NOW + 1)  # the same one again
    with pytest.raises(FleetError, match="from the proxy's clock") as stale:
        fleet.register(registration(sent_at=NOW - FRESH_S - 1), NOW)
    assert stale.value.status == 403
    with pytest.raises(FleetError, match="compatibility hash") as other:
        fleet.register(registration(url=D, roles=["decode"], sent_at=NOW, compat_hash="xyz"), NOW)
    assert other.value.status == 409
    for bad in (registration(roles=["prefill"], role="decode"), registration(roles=["middle"]),
                registration(state="asleep"), registration(lease_s=0.1), registration(url="http://10.1.1.1:1")):
        bad.sent_at = NOW + 5
        with pytest.raises(FleetError):
            fleet.register(bad, NOW + 5)


def test_a_server_that_drains_and_leaves_through_its_registration() -> None:
    fleet, _, _ = make_fleet()
    instance = fleet.register(registration(role="prefill"), NOW)
    instance.outstanding = 1
    fleet.register(registration(role="prefill", sent_at=NOW + 1, state="draining"), NOW + 1)
    assert instance.draining and fleet.find(BOTH) is instance
    fleet.register(registration(role="prefill", sent_at=NOW + 2, state="leaving"), NOW + 2)
    assert fleet.find(BOTH) is instance  # leaves once its request ends
    instance.outstanding = 0
    fleet.tick()
    assert fleet.find(BOTH) is None


def test_a_server_registering_again_without_its_current_role_is_moved() -> None:
    fleet, _, _ = make_fleet()
    fleet.register(registration(role="prefill"), NOW)
    moved = fleet.register(registration(roles=["decode"], role="decode", sent_at=NOW + 1), NOW + 1)
    assert moved.role == "decode" and moved in fleet.pools["decode"].instances


def test_a_server_leaving_with_other_roles_than_it_had_is_moved_then_taken_out() -> None:
    fleet, _, _ = make_fleet()
    fleet.register(registration(role="prefill"), NOW)
    fleet.register(registration(roles=["decode"], role="decode", sent_at=NOW + 1, state="leaving"), NOW + 1)
    assert fleet.find(BOTH) is None and [c.action for c in fleet.changes][-2:] == ["drained", "removed"]
