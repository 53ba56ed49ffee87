"""Picking instances: the three policies, exclusion and health, and the prefix key."""

from __future__ import annotations

from collections import Counter

import pytest

from proxy.forward import prefix_key
from proxy.instances import LOAD_SLACK, EmptyPoolError, Instance, InstancePool, NoInstanceError, Route

URLS = [f"http://127.0.0.1:{8100 + i}" for i in range(4)]


def test_round_robin_takes_each_instance_in_turn() -> None:
    pool = InstancePool.of(URLS, "decode", "round_robin")
    picks = Counter(pool.pick(Route(f"key {i}")).url for i in range(40))
    assert picks == {url: 10 for url in URLS}


def test_least_loaded_takes_the_instance_with_fewest_outstanding() -> None:
    pool = InstancePool.of(URLS, "decode", "least_loaded")
    for instance, load in zip(pool.instances, [3, 1, 0, 2]):
        instance.outstanding = load
    assert pool.pick(Route("k")).url == URLS[2]
    pool.instances[2].outstanding = 5
    assert pool.pick(Route("k")).url == URLS[1]


def test_prefix_aware_keeps_a_prefix_on_one_instance_and_spreads_prefixes() -> None:
    pool = InstancePool.of(URLS, "prefill", "prefix_aware")
    families = [f"system prompt of family {f}. " * 10 for f in range(64)]
    chosen = {f: {pool.pick(Route(prefix_key({"prompt": fam + f" question {q}"}))).url for q in range(5)}
              for f, fam in enumerate(families)}
    assert all(len(urls) == 1 for urls in chosen.values())  # one instance per family
    spread = Counter(next(iter(urls)) for urls in chosen.values())
    assert len(spread) == len(URLS) and min(spread.values()) >= 5  # families spread over all


def test_prefix_aware_leaves_a_saturated_instance_for_the_least_loaded() -> None:
    pool = InstancePool.of(URLS, "decode", "prefix_aware")
    home = pool.pick(Route("family"))
    home.outstanding = LOAD_SLACK
    assert pool.pick(Route("family")) is home  # still within the slack
    home.outstanding = LOAD_SLACK + 1
    assert pool.pick(Route("family")) is not home


def test_unhealthy_and_excluded_instances_are_skipped_until_none_is_left() -> None:
    pool = InstancePool.of(URLS[:2], "prefill", "round_robin")
    pool.instances[0].mark_failed("down")
    assert {pool.pick(Route(str(i))).url for i in range(4)} == {URLS[1]}
    with pytest.raises(NoInstanceError, match="no healthy prefill instance"):
        pool.pick(Route("k"), exclude={URLS[1]})
    assert pool.instances[0].state()["last_error"] == "down" and pool.instances[0].failures == 1


def test_a_pool_refuses_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_aware"):
        InstancePool.of(URLS, "decode", "random")


def test_an_empty_pool_says_no_instance_and_takes_instances_that_join() -> None:
    pool = InstancePool.of([], "decode", "prefix_aware")
    with pytest.raises(EmptyPoolError, match="no decode instance"):
        pool.pick(Route("k"))
    joined = Instance(URLS[0], "prefill")
    pool.add(joined)
    assert joined.role == "decode" and pool.pick(Route("k")) is joined  # the ring has it
    pool.add(Instance(URLS[1], "decode"))
    pool.remove(joined)
    assert {pool.pick(Route(f"k{i}")).url for i in range(20)} == {URLS[1]}


def test_a_draining_instance_takes_no_new_request() -> None:
    pool = InstancePool.of(URLS[:2], "prefill", "least_loaded")
    pool.instances[1].outstanding = 5
    pool.instances[0].draining = True
    assert {pool.pick(Route(f"k{i}")).url for i in range(10)} == {URLS[1]}
    pool.instances[1].draining = True
    with pytest.raises(NoInstanceError, match="no healthy prefill instance"):
        pool.pick(Route("k"))


def test_prefix_key_reads_text_token_ids_and_chat() -> None:
    long = "x" * 1000
    assert prefix_key({"prompt": long}) == "x" * 256
    assert prefix_key({"prompt": [long]}) == "x" * 256
    assert prefix_key({"prompt": list(range(100))}) == prefix_key({"prompt": [list(range(64)) + [7]]})
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert prefix_key(chat).startswith("system:Be brief.\nuser:Hi")
    assert prefix_key({}) == ""
