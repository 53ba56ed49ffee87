"""KVCacheManager driven like a scheduler drives it, against a model of the KV data.

`Simulator` plays the model runner: every step it checks that the blocks a request reads
hold exactly that request's tokens (full attention: every block before the first new
token; sliding window: the blocks covering the window; Mamba: the block holding the state
after the last computed token), then "writes" the new tokens' KV into the blocks that
cover them, which must be real blocks held by this request alone. A block's content is
the token prefix it was computed from, so a prefix-cache hit on wrong or overwritten data,
a write into a shared block, or a missing block fails at once. `check_integrity()` runs
after every operation and every run ends with all blocks free.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_events.messages import AllBlocksCleared, BlockStored
from pd.contracts.request import Request
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from pd.kv_transfer.params import RemotePrefillParams

BLOCK = 16

# A remote-prefill request's parameters; the manager reads only that they are there.
REMOTE = RemotePrefillParams(True, "p", "127.0.0.1", 1, "p1", [[0]], 1, 0, 16)


def attn(window: int | None = None) -> FullAttentionSpec:
    kw = dict(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float32")
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def ssm() -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK,
        num_heads=2, head_dim=4, state_size=4, n_groups=1, conv_width=3,
        conv_dtype="float32",
        ssm_dtype="float32",
    )


MODELS: dict[str, list[KVCacheSpec]] = {
    "full": [attn()] * 2,
    "gemma3": [attn(40)] * 5 + [attn()] + [attn(40)] * 5 + [attn()],
    "bamba": [ssm(), ssm(), attn(), ssm(), ssm(), attn()],
    "hybrid3": [ssm(), attn(24), attn(), ssm(), attn(24), attn()],
    "no_full": [attn(33), ssm(), attn(33), ssm()],
    "sliding_only": [attn(17)] * 3,
}


def make_manager(model: str, blocks: int, caching: bool = True, **kw) -> KVCacheManager:
    specs = {f"layer{i}": s for i, s in enumerate(MODELS[model])}
    page_row = make_kv_cache_config(specs, 1 << 30).cross_layer_page_bytes
    config = make_kv_cache_config(specs, blocks * page_row)
    return KVCacheManager(config, enable_caching=caching, **kw)


class Simulator:
    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block id -> (group, tokens)

    def needed_for_read(self, spec: KVCacheSpec, num_computed: int) -> range:
        """Block indices whose data the next token at `num_computed` reads."""
        bs = spec.block_size
        if isinstance(spec, MambaSpec):
            return range((num_computed - 1) // bs, cdiv(num_computed, bs)) if num_computed else range(0)
        if isinstance(spec, SlidingWindowSpec):
            first = max(0, num_computed - spec.sliding_window + 1) // bs
            return range(first, cdiv(num_computed, bs))
        return range(cdiv(num_computed, bs))

    def step(self, request: Request, num_new: int) -> None:
        """Check the reads, write the KV of `num_new` tokens, cache what became full."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        tokens = tuple(request.all_token_ids)
        for group_id, group in enumerate(self.manager.config.groups):
            blocks = self.manager.get_blocks(request.request_id).blocks[group_id]
            bs = group.spec.block_size
            for i in self.needed_for_read(group.spec, start):
                expected = (group_id, tokens[: min((i + 1) * bs, start)])
                assert self.content.get(blocks[i].block_id) == expected, (group_id, i)
            for i in range(start // bs, cdiv(end, bs)):
                block = blocks[i]
                assert not block.is_null and block.ref_cnt == 1, (group_id, i, block)
                assert block.block_hash is None, "writing into a cached block"
                self.content[block.block_id] = (group_id, tokens[: min((i + 1) * bs, end)])
        request.num_computed_tokens = end
        self.manager.cache_blocks(request, end)
        self.manager.check_integrity()

    def admit(self, request: Request, chunk: int) -> bool:
        """Prefix lookup + allocation of the first chunk; False if the pool is short."""
        blocks, hit = self.manager.get_computed_blocks(request)
        assert hit % BLOCK == 0 and hit < request.num_tokens
        num_new = min(chunk, request.num_tokens - hit)
        if self.manager.allocate_slots(request, num_new, hit, blocks) is None:
            self.manager.check_integrity()
            return False
        request.num_computed_tokens = hit
        self.step(request, num_new)
        return True

    def fork(self, parent: Request, child_id: str) -> Request | None:
        """A new request holding the parent's computed tokens, copy on write (the
        block copies applied to the data model, as the runner applies them); None if
        the pool is short."""
        child = Request(child_id, list(parent.prompt_token_ids))
        child.output_token_ids = list(parent.output_token_ids)
        copies = self.manager.fork(parent, child)
        self.manager.check_integrity()
        if copies is None:
            return None
        for source, copy in copies:
            self.content[copy] = self.content[source]
        child.num_computed_tokens = parent.num_computed_tokens
        return child

    def advance(self, request: Request, chunk: int, rng: random.Random) -> bool:
        """Next prefill chunk, or one decode token; False if the pool is short."""
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(rng.randrange(50))
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.manager.allocate_slots(request, num_new) is None:
            self.manager.check_integrity()
            return False
        self.step(request, num_new)
        return True


def apply_events(mirror: set[tuple[bytes, int]], events) -> None:
    """A subscriber's view: (hash, group) of every block said to be cached."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            mirror.clear()
        elif isinstance(event, BlockStored):
            assert not {(h, event.group) for h in event.block_hashes} & mirror, "stored twice"
            mirror.update((h, event.group) for h in event.block_hashes)
        else:
            assert {(h, event.group) for h in event.block_hashes} <= mirror, "removed without being stored"
            mirror.difference_update((h, event.group) for h in event.block_hashes)


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.randrange(0, 100)]
    return prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 60))]


@settings(max_examples=120, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    blocks=st.integers(20, 80),
    caching=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_schedules_keep_data_and_integrity(model, blocks, caching, seed) -> None:
    """...and the KV events the pool records, applied in order, say exactly which blocks
    are cached after every operation (what a router following them would hold)."""
    rng = random.Random(seed)
    sim = Simulator(make_manager(model, blocks, caching, record_events=True))
    mirror: set[tuple[bytes, int]] = set()
    prefixes = [[rng.randrange(50) for _ in range(100)] for _ in range(3)]
    running: list[Request] = []
    for n in range(60):
        op = rng.random()
        if op < 0.3 or not running:
            request = Request(f"r{n}", random_prompt(rng, prefixes))
            if sim.admit(request, chunk=rng.choice([16, 32, 1000])):
                running.append(request)
        elif op < 0.4:  # fork a request whose known tokens are all computed (as at its first token)
            parent = rng.choice(running)
            if parent.num_computed_tokens == parent.num_tokens and (child := sim.fork(parent, f"f{n}")):
                running.append(child)
        elif op < 0.85:
            request = rng.choice(running)
            if not sim.advance(request, rng.choice([16, 48, 1000]), rng):
                running.remove(request)  # preempted: the scheduler frees it
                sim.manager.free(request)
        else:
            request = running.pop(rng.randrange(len(running)))
            sim.manager.free(request)
        sim.manager.check_integrity()
        apply_events(mirror, sim.manager.pool.take_events())
        assert mirror == {(key.block_hash, key.group_id) for key in sim.manager.pool.cached}
    for request in running:
        sim.manager.free(request)
    sim.manager.check_integrity()
    assert sim.manager.usage == 0.0
    assert sim.manager.num_free_blocks == sim.manager.config.num_blocks - 1


@pytest.mark.parametrize("model", sorted(MODELS))
def test_second_request_hits_the_shared_prefix(model: str) -> None:
    sim = Simulator(make_manager(model, 200))
    prefix = list(range(100, 164))  # 4 full blocks
    first = Request("a", prefix + [1, 2, 3])
    assert sim.admit(first, chunk=1000)
    second = Request("b", prefix + [7, 8, 9])
    blocks, hit = sim.manager.get_computed_blocks(second)
    assert hit == 64
    assert sim.manager.allocate_slots(second, second.num_tokens - hit, hit, blocks) is not None
    second.num_computed_tokens = hit
    sim.step(second, second.num_tokens - hit)  # reads the hit blocks: checks their data
    stats = sim.manager.stats
    assert stats.queries == first.num_tokens + second.num_tokens and stats.hits == 64
    assert stats.group_hits == [64] * len(stats.group_hits)


def test_skipping_the_partial_groups_keeps_the_attention_hit() -> None:
    # The prefix's attention blocks are cached, but no Mamba state at the hit point.
    manager = make_manager("bamba", 200)
    sim = Simulator(manager)
    prefix = list(range(64))
    first = Request("a", prefix + [1])
    assert sim.admit(first, chunk=1000)
    mamba_groups = [i for i, g in enumerate(manager.config.groups) if isinstance(g.spec, MambaSpec)]
    # Drop the Mamba states so only attention can hit, as on a decode server whose
    # Mamba blocks were evicted.
    for key in [k for k in manager.pool.cached if k.group_id in mamba_groups]:
        manager.pool.cached.pop(key).block_hash = None
    manager.check_integrity()
    local = Request("local", prefix + [5, 6])
    assert manager.get_computed_blocks(local)[1] == 0
    remote = Request("remote", prefix + [5, 6], kv_transfer_params=REMOTE)
    assert manager.partial_prefix_groups == frozenset(mamba_groups)
    blocks, hit = manager.get_computed_blocks(remote, manager.partial_prefix_groups)
    assert hit == 64
    for g in mamba_groups:
        assert blocks.blocks[g] == []  # no hit: its state comes from the prefill server
    assert manager.get_computed_blocks(remote)[1] == 0  # the KV core does not read the request's PD fields


def test_remote_prefill_keeps_the_full_attention_hit_and_loads_only_the_rest() -> None:
    # D holds a prefix's full-attention blocks, but neither the window's blocks at the
    # hit point nor a Mamba state there (as after an earlier P-then-D request, which
    # brought only its last window and final state).
    manager = make_manager("hybrid3", 200)
    sim = Simulator(manager)
    prefix = list(range(64))
    assert sim.admit(Request("a", prefix + [1]), chunk=1000)
    partial = {i for i, g in enumerate(manager.config.groups) if not isinstance(g.spec, FullAttentionSpec)}
    for key in [k for k in manager.pool.cached if k.group_id in partial]:
        manager.pool.cached.pop(key).block_hash = None
    prompt = prefix + list(range(500, 536))  # 100 tokens: 7 blocks, 4 of them hits
    assert manager.get_computed_blocks(Request("local", prompt))[1] == 0  # collapsed
    request = Request("r", prompt, kv_transfer_params=REMOTE)
    blocks, hit = manager.get_computed_blocks(request, manager.partial_prefix_groups)
    assert hit == 64
    assert manager.allocate_slots(request, 0, hit, blocks, num_external_computed_tokens=100 - hit) is not None
    unfilled = manager.get_blocks("r").get_unfilled_block_ids()
    for group, ids in zip(manager.config.groups, unfilled):
        to_load = [i for i, b in enumerate(ids) if b != 0]
        if isinstance(group.spec, MambaSpec):
            assert to_load == [99 // BLOCK]  # the final state only
        elif isinstance(group.spec, SlidingWindowSpec):
            assert to_load == list(range((100 - 24 + 1) // BLOCK, 7))  # the last window, hits or not
        else:
            assert to_load == [4, 5, 6]  # past the hit
    manager.check_integrity()


def test_remote_prefill_allocation_leaves_out_of_reach_positions_null() -> None:
    # D allocates for the whole prompt at once with the prompt arriving from outside:
    # Mamba needs only the block for the final state, the window only its last blocks.
    manager = make_manager("hybrid3", 200)
    prompt = list(range(100))
    request = Request("r", prompt, kv_transfer_params=REMOTE)
    blocks, hit = manager.get_computed_blocks(request)
    assert hit == 0
    new = manager.allocate_slots(request, 0, 0, blocks, num_external_computed_tokens=100)
    assert new is not None
    for group, ids in zip(manager.config.groups, manager.get_block_ids("r")):
        assert len(ids) == cdiv(100, BLOCK)
        real = [i for i, b in enumerate(ids) if b != 0]
        if isinstance(group.spec, MambaSpec):
            assert real == [99 // BLOCK]
        elif isinstance(group.spec, SlidingWindowSpec):
            assert real == list(range((100 - 24 + 1) // BLOCK, 7))
        else:
            assert real == list(range(7))
    manager.check_integrity()
    manager.free(request)
    assert manager.usage == 0.0


def test_sliding_window_and_mamba_release_blocks_while_decoding() -> None:
    manager = make_manager("no_full", 200)
    sim = Simulator(manager)
    request = Request("r", list(range(20)))
    assert sim.admit(request, chunk=1000)
    rng = random.Random(0)
    for _ in range(150):
        assert sim.advance(request, 1, rng)
    # At most the window's blocks (+1 partial) and 2 Mamba blocks are held per group.
    held = [sum(1 for b in ids if b != 0) for ids in manager.get_block_ids("r")]
    for group, count in zip(manager.config.groups, held):
        if isinstance(group.spec, MambaSpec):
            assert count <= 2
        else:
            assert count <= cdiv(group.spec.sliding_window - 1, BLOCK) + 1
    manager.free(request)
    manager.check_integrity()


def test_allocation_failure_takes_nothing() -> None:
    manager = make_manager("full", 6)  # 5 usable blocks
    big = Request("big", list(range(200)))
    blocks, hit = manager.get_computed_blocks(big)
    free_before = manager.num_free_blocks
    assert manager.allocate_slots(big, 200, hit, blocks) is None
    assert manager.num_free_blocks == free_before
    assert manager.get_block_ids("big") == [[], []] or manager.get_block_ids("big") == [[]]
    manager.check_integrity()


def test_block_ids_are_groups_outer() -> None:
    manager = make_manager("bamba", 100)
    request = Request("r", list(range(40)))
    blocks, hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, 40, hit, blocks)
    ids = manager.get_block_ids("r")
    assert len(ids) == len(manager.config.groups) == len(new.get_block_ids())
    assert all(isinstance(b, int) for group in ids for b in group)
    assert all(len(group) == cdiv(40, BLOCK) for group in ids)


def test_usage_and_reset_prefix_cache() -> None:
    manager = make_manager("gemma3", 100)
    sim = Simulator(manager)
    request = Request("r", list(range(64)))
    assert sim.admit(request, chunk=1000)
    assert manager.usage > 0
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.usage == 0.0 and manager.pool.cached
    assert manager.reset_prefix_cache() and not manager.pool.cached
    assert manager.get_computed_blocks(Request("again", list(range(64))))[1] == 0


def test_allocating_past_max_model_len_is_refused() -> None:
    manager = make_manager("full", 100, max_model_len=64)
    request = Request("r", list(range(60)))
    assert manager.allocate_slots(request, 60) is not None
    request.num_computed_tokens = 60
    with pytest.raises(ValueError, match="max_model_len=64"):
        manager.allocate_slots(request, 5)
    manager.check_integrity()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("length", [BLOCK * 3, BLOCK * 3 + 5])
def test_a_fork_shares_full_blocks_and_copies_the_one_being_written(model: str, length: int) -> None:
    """Both go on decoding: each writes only its own block (the Simulator checks that
    every block written is held by one request), and reads its own tokens' data."""
    sim = Simulator(make_manager(model, 200))
    parent = Request("p", list(range(100, 100 + length)))
    assert sim.admit(parent, chunk=1000)
    held_before = sim.manager.num_free_blocks
    child = sim.fork(parent, "p/1")
    partial = [g for g, ids in enumerate(sim.manager.get_block_ids("p"))
               if length % BLOCK and ids[length // BLOCK] != 0]
    assert held_before - sim.manager.num_free_blocks == len(partial)  # one new block per block being written
    for g, (ours, theirs) in enumerate(zip(sim.manager.get_block_ids("p"), sim.manager.get_block_ids("p/1"))):
        full = length // BLOCK
        assert theirs[:full] == ours[:full]
        if g in partial:
            assert theirs[full] != ours[full]
    rng = random.Random(1)
    for _ in range(40):
        assert sim.advance(parent, 1, rng) and sim.advance(child, 1, rng)
    for request in (parent, child):
        sim.manager.free(request)
    sim.manager.check_integrity()
    assert sim.manager.usage == 0.0


def test_a_fork_the_pool_cannot_hold_takes_nothing() -> None:
    manager = make_manager("full", 4)  # 3 usable blocks
    sim = Simulator(manager)
    parent = Request("p", list(range(40)))  # 3 blocks, the last partial: a fork needs one more
    assert sim.admit(parent, chunk=1000)
    assert manager.num_free_blocks == 0
    assert sim.fork(parent, "p/1") is None
    assert manager.num_free_blocks == 0 and manager.get_block_ids("p/1") == [[]]
    exact = make_manager("full", 4)
    sim = Simulator(exact)
    parent = Request("p", list(range(48)))  # 3 full blocks: a fork shares them all
    assert sim.admit(parent, chunk=1000)
    assert sim.fork(parent, "p/1") is not None and exact.get_block_ids("p/1") == exact.get_block_ids("p")


def test_a_request_looking_up_again_while_it_waits_for_room_is_one_query() -> None:
    """A waiting request's prefix is looked up at every admission attempt; before this
    fix each attempt was counted, so a cache short of room showed a hit rate divided by
    the attempts (12.7 % for what was 60 %+ in the disk tier's benchmark)."""
    sim = Simulator(make_manager("full", 200))
    prefix = list(range(100, 164))
    first = Request("a", prefix + [1, 2, 3])
    assert sim.admit(first, chunk=1000)
    second = Request("b", prefix + [7, 8, 9])
    for _ in range(3):  # three attempts that find no room
        sim.manager.get_computed_blocks(second)
    blocks, hit = sim.manager.get_computed_blocks(second)
    assert sim.manager.allocate_slots(second, second.num_tokens - hit, hit, blocks) is not None
    stats = sim.manager.stats
    assert stats.requests == 2 and stats.queries == first.num_tokens + second.num_tokens and stats.hits == 64
    third = Request("c", prefix + [4])
    sim.manager.get_computed_blocks(third)
    sim.manager.free(third)  # aborted while waiting: never counted
    assert sim.manager.stats.requests == 2
