"""What the proxy knows of one server's prefix cache: the blocks its KV events say it
holds (kv_events/), in the one KV cache group routing looks at.

An index follows one engine (`engine_id`) from batch to batch: batch `last_seq + 1` is
applied; an older one is a duplicate and ignored; a newer one leaves a gap, which
`apply` reports so that the subscriber asks for a replay; a batch from another engine
means the server restarted, and the index starts empty. A snapshot replaces everything.
The blocks held are bounded (`max_blocks`): past the bound, stored blocks are not
recorded (the index under-counts, never over-counts) and counted in `dropped`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kv_events.messages import AllBlocksCleared, BlockStored, EventBatch

MAX_BLOCKS = 2_000_000  # per server: more than any cache this proxy fronts holds in its routing group


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
    blocks: set[bytes] = field(default_factory=set)
    dropped: int = 0  # stored blocks not recorded for the bound

    def clear(self) -> None:
        """Forget everything (the server is gone or restarted)."""
        self.engine_id, self.last_seq = None, 0
        self.blocks.clear()

    def apply(self, batch: EventBatch) -> Applied:
        if batch.engine_id != self.engine_id:
            self.clear()
            self.engine_id = batch.engine_id
        if batch.snapshot:
            if batch.seq < self.last_seq:
                return Applied.DUPLICATE
            self.blocks.clear()
        elif batch.seq <= self.last_seq:
            return Applied.DUPLICATE
        elif batch.seq > self.last_seq + 1:
            return Applied.GAP
        for event in batch.events:
            self._apply_event(event)
        self.last_seq = batch.seq
        return Applied.APPLIED

    def _apply_event(self, event) -> None:
        if isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        elif event.group != self.group:
            return
        elif isinstance(event, BlockStored):
            room = max(0, self.max_blocks - len(self.blocks))
            self.blocks.update(event.block_hashes[:room])
            self.dropped += max(0, len(event.block_hashes) - room)
        else:
            self.blocks.difference_update(event.block_hashes)

    def overlap(self, block_hashes: list[bytes]) -> int:
        """How many of a prompt's leading blocks the server holds (a prefix-cache hit
        reaches as far as the first block it lacks)."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self.blocks:
                return i
        return len(block_hashes)
