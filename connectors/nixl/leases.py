"""Lease words: how a decode server knows that the blocks it read were still the prompt's.

P frees a request's blocks on D's read-done notification, on a reject, on a release or
at the lease's end; the blocks may then be reused at once. A READ that D posted before
P freed them, and that moved bytes after, would carry another request's KV: D would
answer wrong tokens and keep them in its prefix cache. So each request P keeps blocks
for holds a slot of P's lease table, a word in registered host memory whose value (a
token, never reused) P names in the parameters it signs, and sets to 0 before the blocks
can be freed. D reads the blocks, then (a second READ, posted once the first is DONE)
the word, and acts on the blocks only if the word still holds the token: the blocks
were held at least until its data READ ended. D sends the read-done notification only
after that check, so P frees only after both READs.

Every engine with the NIXL connector has one table of `2 * num_slots` int64 words:
`[0, num_slots)` are its slots as P, `[num_slots, 2 * num_slots)` its landing words as D
(one per verifying read in flight).
"""

from __future__ import annotations

import secrets

import torch

WORD_BYTES = 8
MAX_TOKEN = 2**63 - 1


class LeaseTable:
    """`num_slots` lease slots and as many landing words. Not thread-safe: the engine's
    thread uses it (the connector's scheduler half holds, the worker half releases)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.words = torch.zeros(2 * num_slots, dtype=torch.int64)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_landing = list(range(2 * num_slots - 1, num_slots - 1, -1))
        self._slots: dict[str, int] = {}  # request id -> its slot
        self._next_token = secrets.randbelow(2**62) + 1  # a restarted P never reissues a token

    @property
    def base_address(self) -> int:
        return self.words.data_ptr()

    @property
    def num_held(self) -> int:
        return len(self._slots)

    def hold(self, request_id: str) -> tuple[int, int]:
        """A slot for the request's blocks, and its token (written to the slot now);
        RuntimeError if every slot is held."""
        if request_id in self._slots:
            raise ValueError(f"request {request_id!r} holds a lease slot already")
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} lease slots are held")
        slot, token = self._free_slots.pop(), self._next_token
        self._next_token = self._next_token % MAX_TOKEN + 1
        self._slots[request_id] = slot
        self.words[slot] = token
        return slot, token

    def release(self, request_id: str) -> None:
        """The request's blocks may be freed: its slot reads 0 from now on. Ids holding
        no slot are ignored."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.words[slot] = 0
            self._free_slots.append(slot)

    def take_landing(self) -> int:
        """A landing word's index for a verifying read (RuntimeError if none is free)."""
        if not self._free_landing:
            raise RuntimeError(f"all {self.num_slots} landing words are in use")
        index = self._free_landing.pop()
        self.words[index] = 0
        return index

    def landed(self, index: int) -> int:
        """What a verifying read put in landing word `index`; the word is free again."""
        value = int(self.words[index])
        self._free_landing.append(index)
        return value
