"""Tensor parallelism: which share of a model a rank holds (plain data, no torch).

A model is built for one `TPShard` (rank `rank` of `size`, in `ModelConfig.tp`): its
projections hold that rank's slice of every weight (`pd/models/parallel.py`), and
where a slice's partial result must be summed or joined, the layer calls the
collectives of `pd/distributed/collectives.py`.

How heads split (vLLM's rule): query heads, Mamba heads and MLP channels are cut into
`size` equal runs; KV heads (and Mamba groups) too when `size` divides them, and when
there are fewer than ranks each rank holds one, replicated: rank r holds head
`r * total // size`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size`."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a rank")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(first, count) of `total` equal units on this rank; ValueError unless `size`
        divides `total`."""
        if total % self.size:
            raise ValueError(f"tensor-parallel size {self.size} does not divide the {total} {what}")
        count = total // self.size
        return self.rank * count, count

    def replicated_split(self, total: int, what: str) -> tuple[int, int]:
        """As `split`, or one replicated unit per rank when there are fewer than ranks
        (then `size` must be a multiple of `total`)."""
        if total >= self.size or self.size % total:
            return self.split(total, what)
        return self.rank * total // self.size, 1

    def rows(self, total: int) -> tuple[int, int]:
        """(first, count) of `total` rows cut into `size` runs of `ceil(total / size)`
        (the last run may be short or empty: a vocabulary need not divide)."""
        per_rank = -(-total // self.size)
        first = min(self.rank * per_rank, total)
        return first, min(per_rank, total - first)
