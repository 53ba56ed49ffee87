"""Rank 0's book of the digests its engine's ranks made of held requests' blocks
(pd/kv_transfer/digests.py): each rank digests its own heads of a request's blocks in the
step that computes the last of its prompt (rank 0 itself, ranks 1..N-1 reporting them in
that step's output), and the scheduler half takes them all into the request's signed
parameters when it finishes, in that same step's update."""

from __future__ import annotations


class DigestBook:
    """Not thread-safe: the engine's thread uses it (the worker half puts, the scheduler
    half takes)."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._by_request: dict[str, dict[int, bytes]] = {}

    def put(self, request_id: str, rank: int, digests: bytes) -> None:
        self._by_request.setdefault(request_id, {})[rank] = digests

    def take(self, request_id: str) -> list[bytes] | None:
        """Every rank's digests of the request, in rank order, forgotten here; None
        unless every rank made them."""
        by_rank = self._by_request.pop(request_id, {})
        if len(by_rank) != self.tp_size:
            return None
        return [by_rank[rank] for rank in range(self.tp_size)]

    def __len__(self) -> int:
        return len(self._by_request)
