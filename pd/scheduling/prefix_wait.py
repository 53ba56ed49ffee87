"""Requests that wait for a prompt prefix another request is computing.

A new (or preempted) request whose prompt shares at least `SHARED_BLOCKS_TO_WAIT` full
blocks with prompt blocks a running request computes in this step or later waits, keeping
its turn, until they are cached, rather than computing them a second time: a burst of
requests with one new system prompt computes it once (SGLang's in-batch prefix caching
does the like). A block's hash covers every token before it, so shared hashes are a
shared prefix. Not with the prefix cache off, for a request whose KV comes from a remote
prefill, or for one that scores its prompt (it computes every token)."""

from __future__ import annotations

from collections.abc import Iterable

from kv_events.hashing import BlockHash
from pd.contracts.request import Request

SHARED_BLOCKS_TO_WAIT = 2  # prompt blocks another request is computing that make a new one wait a step


def blocks_to_compute(request: Request, block_size: int) -> list[BlockHash]:
    """Hashes of the full prompt blocks a running request has yet to compute (this step's
    among them: its computed tokens advance after the step)."""
    if not request.reads_prefix_cache or request.num_computed_tokens >= request.num_prompt_tokens:
        return []
    hashes = request.block_hashes(block_size)
    return hashes[request.num_computed_tokens // block_size:request.num_prompt_tokens // block_size]


class PrefixesComputing:
    """One step's prompt blocks being computed: those of the running requests, then of each
    request the step admits (`add`); none with the prefix cache off (`enabled` False)."""

    def __init__(self, running: list[Request], block_size: int, enabled: bool) -> None:
        self.block_size, self.enabled = block_size, enabled
        self.hashes = {h for r in running for h in blocks_to_compute(r, block_size)} if enabled else set()
        self.found_waiting: set[str] = set()  # request ids found to wait this step

    def add(self, request: Request) -> None:
        if self.enabled:
            self.hashes.update(blocks_to_compute(request, self.block_size))

    def first_free(self, in_turn: Iterable[Request]) -> Request | None:
        """The first request of `in_turn` that does not wait; those found to wait are
        remembered and not checked again this step (one pass over the queue)."""
        for request in in_turn:
            if request.request_id in self.found_waiting:
                continue
            if not self.waits(request):
                return request
            self.found_waiting.add(request.request_id)
        return None

    def waits(self, request: Request) -> bool:
        """Whether the waiting request waits for blocks being computed."""
        if not self.hashes or request.num_computed_tokens or request.kv_source is not None \
                or not request.reads_prefix_cache:
            return False
        hashes = request.block_hashes(self.block_size)[:request.num_prompt_tokens // self.block_size]
        return sum(1 for h in hashes if h in self.hashes) >= SHARED_BLOCKS_TO_WAIT
