"""What the proxy knows of one server's prefix cache: the blocks its KV events say it
holds (kv_events/), in the one KV cache group routing looks at, in its KV cache itself
(`blocks`) and in its offload tiers (`lower`, by medium). A block held only in a tier
counts for its tier's weight in `overlap` (`--kv-tier-weights`: a disk hit still has to
be read back, a device hit does not).

An index follows one engine (`engine_id`) from batch to batch: batch `last_seq + 1` is
applied; an older one is a duplicate and ignored; a newer one leaves a gap, which
`apply` reports so that the subscriber asks for a replay; a batch from another engine
means the server restarted, and the index starts empty. A snapshot replaces everything.
The blocks held are bounded (`max_blocks`): past the bound, stored blocks are not
recorded (the index under-counts, never over-counts) and counted in `dropped`.

Events come after the fact: a request's blocks are published once the server has
computed them, while the next request with the same prefix may arrive meanwhile. So the
router also `expect`s the blocks of each prompt it sends to the server: they count as
held until its events store them (or remove them), or for `ttl_s` at most.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from kv_events.messages import AllBlocksCleared, BlockStored, EventBatch, KVEvent

DEFAULT_TIER_WEIGHTS = {"device": 1.0, "host": 0.8, "disk": 0.5}  # what a block held in each medium is worth
MAX_BLOCKS = 2_000_000  # per server: more than any cache this proxy fronts holds in its routing group
EXPECTED_TTL_S = 10.0  # a request sent is prefilled, and its blocks published, within this (or they are not)


class Applied(Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already held
    GAP = "gap"  # batches are missing before this one: ask for a replay


@dataclass
class KVIndex:
    group: int = 0  # the KV cache group whose blocks are held
    max_blocks: int = MAX_BLOCKS
    engine_id: str | None = None
    last_seq: int = 0
    blocks: set[bytes] = field(default_factory=set)  # in the server's KV cache ("device")
    lower: dict[str, set[bytes]] = field(default_factory=dict)  # medium -> blocks in that offload tier
    dropped: int = 0  # stored blocks not recorded for the bound
    expected: dict[bytes, float] = field(default_factory=dict)  # block hash -> when the expectation ends
    ttl_s: float = EXPECTED_TTL_S
    clock: object = field(default=time.monotonic, repr=False)

    def clear(self) -> None:
        """Forget everything (the server is gone or restarted)."""
        self.engine_id, self.last_seq = None, 0
        self.blocks.clear()
        self.lower.clear()
        self.expected.clear()

    def expect(self, block_hashes: list[bytes]) -> None:
        """A prompt with these blocks was sent to the server: count them as held until
        its events say (bounded like `blocks`; expired expectations are dropped here)."""
        now = self.clock()
        if len(self.expected) + len(block_hashes) > self.max_blocks:
            self.expected = {h: end for h, end in self.expected.items() if end > now}
        room = max(0, self.max_blocks - len(self.expected))
        end = now + self.ttl_s
        for block_hash in block_hashes[:room]:
            if block_hash not in self.blocks:
                self.expected[block_hash] = end

    def apply(self, batch: EventBatch) -> Applied:
        if batch.engine_id != self.engine_id:
            expected, self.expected = (self.expected if self.engine_id is None else {}), {}  # first batch: kept
            self.clear()
            self.engine_id, self.expected = batch.engine_id, expected
        if batch.snapshot:
            if batch.seq < self.last_seq:
                return Applied.DUPLICATE
            self.blocks.clear()
            self.lower.clear()
        elif batch.seq <= self.last_seq:
            return Applied.DUPLICATE
        elif batch.seq > self.last_seq + 1:
            return Applied.GAP
        for event in batch.events:
            self._apply_event(event)
        self.last_seq = batch.seq
        return Applied.APPLIED

    def _apply_event(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.blocks.clear()
            self.expected.clear()
            return
        if event.group != self.group:
            return
        held = self.blocks if event.medium == "device" else self.lower.setdefault(event.medium, set())
        if event.medium == "device":
            for block_hash in event.block_hashes:  # what was expected is known now
                self.expected.pop(block_hash, None)
        if isinstance(event, BlockStored):
            room = max(0, self.max_blocks - len(self.blocks) - sum(map(len, self.lower.values())))
            held.update(event.block_hashes[:room])
            self.dropped += max(0, len(event.block_hashes) - room)
        else:
            held.difference_update(event.block_hashes)

    def overlap(self, block_hashes: list[bytes], tier_weights: dict[str, float] = DEFAULT_TIER_WEIGHTS) -> float:
        """How many of a prompt's leading blocks the server holds, or is expected to (a
        prefix-cache hit reaches as far as the first block it lacks), each counted for
        the weight of the best medium holding it."""
        now, total = None, 0.0
        device = tier_weights.get("device", 1.0)
        for block_hash in block_hashes:
            if block_hash in self.blocks:
                total += device
                continue
            end = self.expected.get(block_hash)
            now = self.clock() if now is None else now
            if end is not None and end > now:
                total += device
                continue
            weight = max((tier_weights.get(m, 0.0) for m, held in self.lower.items() if block_hash in held),
                         default=0.0)
            if weight <= 0:
                break
            total += weight
        return total
