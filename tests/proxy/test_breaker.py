"""The circuit breaker of one instance, on an injected clock, and a pool's breakers and
`max_outstanding` as `pick` sees them."""

from __future__ import annotations

import pytest

from proxy.breaker import Breaker
from proxy.instances import InstancePool, NoInstanceError, OverloadedError, Route

URLS = [f"http://127.0.0.1:{8100 + i}" for i in range(2)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_threshold_failures_in_a_row_open_it_and_a_success_resets_the_count() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0, clock=Clock())
    assert not breaker.failed() and not breaker.failed()
    breaker.succeeded()
    assert not breaker.failed() and not breaker.failed() and breaker.state == "closed" and breaker.allows()
    assert breaker.failed() and breaker.state == "open" and not breaker.allows() and breaker.gauge == 2


def test_after_the_cool_down_one_trial_goes_and_its_success_closes_it() -> None:
    clock = Clock()
    breaker = Breaker(threshold=1, cooldown_s=5.0, clock=clock)
    breaker.failed()
    clock.now += 4.9
    assert not breaker.allows() and breaker.state == "open"
    clock.now += 0.1
    assert breaker.allows() and breaker.state == "half_open" and breaker.gauge == 1
    breaker.start()
    assert not breaker.allows()  # one trial at a time
    breaker.finish()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.allows() and breaker.gauge == 0


def test_a_failed_trial_opens_it_for_another_cool_down() -> None:
    clock = Clock()
    breaker = Breaker(threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(3):
        breaker.failed()
    clock.now += 5
    assert breaker.allows()
    breaker.start()
    assert breaker.failed() and breaker.state == "open"  # one failure is enough when half-open
    clock.now += 4
    assert not breaker.allows()
    clock.now += 1
    assert breaker.allows()


def test_a_trial_that_ends_without_a_verdict_lets_the_next_go() -> None:
    clock = Clock()
    breaker = Breaker(clock=clock)
    breaker.failed()
    clock.now += 5
    assert breaker.allows()
    breaker.start()
    breaker.finish()  # the client left: nothing is known of the server
    assert breaker.allows() and breaker.state == "half_open"


def test_a_pool_skips_an_instance_whose_breaker_is_open_until_its_trial() -> None:
    pool = InstancePool.of(URLS, "prefill", "round_robin", breaker=(1, 5.0))
    clock = Clock()
    pool.instances[0].breaker.clock = clock
    assert pool.instances[0].mark_failed("down")
    assert {pool.pick(Route(str(i))).url for i in range(4)} == {URLS[1]}
    assert pool.instances[0].state()["breaker"] == "open" and not pool.instances[0].healthy
    clock.now += 5
    picks = [pool.pick(Route(str(i))) for i in range(2)]
    assert pool.instances[0] in picks  # half-open: taken for a trial
    pool.instances[0].breaker.start()
    assert {pool.pick(Route(str(i))).url for i in range(4)} == {URLS[1]}  # not while it is under way
    pool.instances[0].mark_succeeded()
    assert pool.instances[0].state()["breaker"] == "closed"


def test_max_outstanding_skips_full_instances_and_is_overloaded_when_all_are() -> None:
    pool = InstancePool.of(URLS, "decode", "least_loaded", max_outstanding=2)
    pool.instances[0].outstanding = 2
    assert pool.pick(Route("k")).url == URLS[1]
    pool.instances[1].outstanding = 2
    with pytest.raises(OverloadedError, match="every decode instance has 2 requests in flight"):
        pool.pick(Route("k"))
    pool.instances[1].mark_failed("down")  # what is left is down, not full
    pool.instances[0].mark_failed("down")
    with pytest.raises(NoInstanceError) as raised:
        pool.pick(Route("k"))
    assert not isinstance(raised.value, OverloadedError)
