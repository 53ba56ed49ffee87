"""The proxy's view of a server's prefix cache (KVIndex) and the kv_aware policy over it:
batches applied in order, duplicates ignored, gaps reported, snapshots and restarts
starting afresh, the bound on what is held; then picking by overlap against load."""

from __future__ import annotations

from kv_events.hashing import extend_block_hashes
from kv_events.messages import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from proxy.instances import Instance, InstancePool, Route
from proxy.kv_index import Applied, KVIndex

H = [bytes([k]) * 32 for k in range(10)]


def batch(seq: int, *events, engine: str = "e1", snapshot: bool = False) -> EventBatch:
    return EventBatch(engine, seq, list(events), snapshot)


def test_batches_apply_in_order_and_gaps_are_reported() -> None:
    index = KVIndex(group=0)
    assert index.apply(batch(1, BlockStored(H[:3], None, 48, 0))) is Applied.APPLIED
    assert index.apply(batch(1, BlockRemoved(H[:3], 0))) is Applied.DUPLICATE  # seen: nothing changes
    assert index.blocks == set(H[:3])
    assert index.apply(batch(3, BlockRemoved(H[:1], 0))) is Applied.GAP  # batch 2 is missing
    assert index.blocks == set(H[:3]) and index.last_seq == 1
    assert index.apply(batch(2, BlockStored(H[3:5], H[2], 32, 0), BlockStored(H[5:6], None, 16, 1))) is Applied.APPLIED
    assert index.blocks == set(H[:5])  # group 1 is not the routing group
    assert index.apply(batch(3, BlockRemoved(H[:1], 0))) is Applied.APPLIED and H[0] not in index.blocks
    assert index.apply(batch(4, AllBlocksCleared())) is Applied.APPLIED and not index.blocks


def test_a_snapshot_replaces_and_another_engine_starts_afresh() -> None:
    index = KVIndex(group=0)
    index.apply(batch(1, BlockStored(H[:4], None, 64, 0)))
    assert index.apply(batch(7, AllBlocksCleared(), BlockStored(H[4:6], None, 32, 0), snapshot=True)) is Applied.APPLIED
    assert index.blocks == set(H[4:6]) and index.last_seq == 7
    assert index.apply(batch(1, BlockStored(H[6:7], None, 16, 0), engine="e2")) is Applied.APPLIED  # restarted
    assert index.blocks == {H[6]} and (index.engine_id, index.last_seq) == ("e2", 1)
    assert index.apply(batch(5, BlockStored(H[7:8], None, 16, 0), engine="e3")) is Applied.GAP
    assert not index.blocks and index.engine_id == "e3"  # what e2 held is gone; a replay fills it


def test_what_is_held_is_bounded() -> None:
    index = KVIndex(group=0, max_blocks=3)
    index.apply(batch(1, BlockStored(H[:5], None, 80, 0)))
    assert len(index.blocks) == 3 and index.dropped == 2


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_expected_blocks_count_until_events_say_or_their_time_ends() -> None:
    clock = Clock()
    index = KVIndex(group=0, ttl_s=10.0, clock=clock)
    index.expect(H[:4])  # a prompt of 4 blocks sent to the server
    assert index.overlap(H[:5]) == 4 and not index.blocks
    index.apply(batch(1, BlockStored(H[:2], None, 32, 0), BlockRemoved(H[2:3], 0)))
    assert index.blocks == set(H[:2]) and set(index.expected) == {H[3]}  # known now: stored, or evicted
    assert index.overlap(H[:5]) == 2
    index.expect(H[5:7])
    clock.now += 10  # never published: expected no more
    assert index.overlap(H[5:7]) == 0
    index.expect(H[7:8])
    index.apply(batch(2, AllBlocksCleared()))
    assert index.overlap(H[7:8]) == 0 and not index.expected


def test_expectations_are_bounded_and_expired_ones_make_room() -> None:
    clock = Clock()
    index = KVIndex(group=0, max_blocks=3, ttl_s=1.0, clock=clock)
    index.expect(H[:5])
    assert len(index.expected) == 3
    clock.now += 2
    index.expect(H[5:7])
    assert set(index.expected) == set(H[5:7])


def test_overlap_counts_the_leading_blocks_held() -> None:
    index = KVIndex(group=0)
    index.apply(batch(1, BlockStored([H[0], H[1], H[3]], None, 48, 0)))
    assert index.overlap([H[0], H[1], H[2], H[3]]) == 2 and index.overlap([H[5]]) == 0 and index.overlap([]) == 0


def pool_of(policy: str = "kv_aware", **weights) -> InstancePool:
    pool = InstancePool.of(["http://a", "http://b", "http://c"], "prefill", policy, **weights)
    for instance in pool.instances:
        instance.kv_index, instance.block_size = KVIndex(group=0), 4
    return pool


def hold(instance: Instance, tokens: list[int]) -> None:
    hashes = extend_block_hashes([], tokens, 4)
    instance.kv_index.apply(batch(instance.kv_index.last_seq + 1, BlockStored(hashes, None, 4 * len(hashes), 0)))


def test_kv_aware_picks_the_instance_holding_most_unless_its_load_outweighs_it() -> None:
    pool = pool_of()
    a, b, c = pool.instances
    prompt = list(range(100, 140))  # 10 blocks
    hold(b, prompt[:32])
    hold(c, prompt[:8])
    route = Route("k", tokens=prompt)
    assert pool.pick(route) is b and b.overlap_tokens(route) == 32
    b.outstanding_tokens = 30  # 32 held - 30 of load < 8 held: c now
    assert pool.pick(route) is c
    assert pool.pick(route, exclude={c.url}) is b
    salted = Route("k", tokens=prompt, salt="tenant-2")  # other block names: nobody holds them
    assert b.overlap_tokens(salted) == 0 and pool.pick(salted) in (a, b, c)


def test_kv_aware_falls_back_to_the_least_loaded_when_nobody_holds_the_prompt() -> None:
    pool = pool_of()
    a, b, c = pool.instances
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert pool.pick(Route("k", tokens=list(range(40)))) is b
    assert pool.pick(Route("k")) is b  # tokens unknown: load
    hold(a, list(range(40)))
    hold(c, list(range(40)))
    assert pool.pick(Route("k", tokens=list(range(40)))) is c  # tied on score: the less loaded


def test_a_decode_server_counts_its_requests_as_load() -> None:
    pool = InstancePool.of(["http://a", "http://b"], "decode", "kv_aware", decode_load_tokens=10)
    for instance in pool.instances:
        instance.kv_index, instance.block_size = KVIndex(group=0), 4
    a, b = pool.instances
    prompt = list(range(24))
    hold(a, prompt[:16])
    hold(b, prompt[:8])
    a.outstanding = 1  # 16 - 10 < 8: b
    assert pool.pick(Route("k", tokens=prompt)) is b


def test_kv_aware_passes_over_an_instance_past_the_load_slack_whatever_it_holds() -> None:
    pool = pool_of(load_slack=2, overlap_weight=100.0)
    a, b, c = pool.instances
    prompt = list(range(100, 140))
    hold(a, prompt)  # a holds everything, worth far more than any load
    b.outstanding = c.outstanding = 1
    route = Route("k", tokens=prompt)
    a.outstanding = 3  # within the slack of the least loaded (1 + 2)
    assert pool.pick(route) is a
    a.outstanding = 4  # past it: the others, by what they hold (nothing), then by load
    assert pool.pick(route) in (b, c)
    hold(c, prompt[:8])
    assert pool.pick(route) is c


def test_a_sent_prompt_attracts_the_next_one_before_the_servers_events_say() -> None:
    pool = pool_of()
    prompt = list(range(200, 240))
    first = pool.pick(Route("k", tokens=prompt))
    first.expect(Route("k", tokens=prompt))  # what the proxy does on sending it
    first.outstanding_tokens = 8  # still prefilling it
    assert all(pool.pick(Route("k", tokens=prompt + [7, 7, 7, 7])) is first for _ in range(3))


def test_blocks_in_an_offload_tier_count_for_their_tiers_weight_and_apart_from_the_device() -> None:
    index = KVIndex(group=0)
    index.apply(batch(1, BlockStored(H[:2], None, 32, 0), BlockStored(H[:4], None, 64, 0, medium="disk")))
    assert index.blocks == set(H[:2]) and index.lower == {"disk": set(H[:4])}
    assert index.overlap(H[:5]) == 2 + 2 * 0.5  # two on the device, two more only on disk
    assert index.overlap(H[:5], {"device": 1.0, "disk": 0.0}) == 2  # a tier weighted 0 is not a hit
    index.apply(batch(2, BlockRemoved(H[:2], 0)))  # evicted from the device, still on disk
    assert index.overlap(H[:5]) == 4 * 0.5
    index.apply(batch(3, AllBlocksCleared()))  # the device's cache reset: the tier keeps its blocks
    assert index.overlap(H[:5]) == 2.0
    index.apply(batch(4, BlockRemoved(H[1:2], 0, medium="disk")))
    assert index.overlap(H[:5]) == 0.5
    index.apply(batch(5, BlockStored(H[5:6], None, 16, 0, medium="disk"), snapshot=True))
    assert index.lower == {"disk": {H[5]}} and index.overlap(H[:5]) == 0


def test_kv_aware_prefers_a_device_hit_over_a_disk_hit_of_the_same_prompt_at_equal_load() -> None:
    pool = pool_of()
    a, b, c = pool.instances
    prompt = list(range(100, 140))
    hashes = extend_block_hashes([], prompt, 4)
    a.kv_index.apply(batch(1, BlockStored(hashes, None, 40, 0, medium="disk")))
    hold(b, prompt)
    route = Route("k", tokens=prompt)
    assert a.overlap_tokens(route) == 20 and b.overlap_tokens(route) == 40
    assert pool.pick(route) is b
    assert pool.pick(route, exclude={b.url}) is a  # a disk hit still beats holding nothing
    for instance in pool.instances:
        instance.tier_weights = {"device": 1.0, "disk": 1.0}
    b.outstanding, c.outstanding = 1, 1  # weighted alike, the less loaded of the two holders
    assert pool.pick(route) is a
