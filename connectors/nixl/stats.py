"""What the NIXL connector counts, for /metrics: cumulative counters and fixed-bucket
histograms (named after vLLM's nixl_* metrics, under pd_kv_transfer_*)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(1, 12))  # 4 KiB .. 4 GiB
COUNT_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)


@dataclass
class Histogram:
    """Observations counted per bucket (`counts[i]`: values <= `buckets[i]`, not
    cumulative; the last count: above every bucket) and their sum."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class TransferStats:
    """Cumulative figures: counters, and histograms per completed read (its time from
    post to completion, the time posting it took, its bytes and descriptors: with tensor
    parallelism each decode rank's share of a request) and per handshake."""

    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    read_descriptors: int = 0
    failures: int = 0
    failed_notifications: int = 0
    leases_expired: int = 0
    rejects_received: int = 0
    released: int = 0
    keep_alives_received: int = 0
    handshakes: int = 0
    handshake_failures: int = 0
    malformed_notifications: int = 0  # NIXL notifications that were not ReadDone, Reject or KeepAlive
    xfer_time: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    post_time: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    bytes_per_read: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))
    descriptors_per_read: Histogram = field(default_factory=lambda: Histogram(COUNT_BUCKETS))
    handshake_time: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    rank_bytes: dict[int, int] = field(default_factory=dict)  # tensor-parallel rank -> bytes it read
    rank_descriptors: dict[int, int] = field(default_factory=dict)  # rank -> descriptors of its reads

    def counters(self) -> dict[str, float]:
        return {name: float(value) for name, value in vars(self).items() if isinstance(value, (int, float))}

    def by_rank(self) -> dict[str, dict[int, int]]:
        """The read figures of each tensor-parallel rank of this decode server."""
        return {"bytes": dict(self.rank_bytes), "descriptors": dict(self.rank_descriptors)}

    def histograms(self) -> dict[str, Histogram]:
        return {name: value for name, value in vars(self).items() if isinstance(value, Histogram)}

    def read_done(self, seconds: float, shares: dict[int, tuple[int, int]]) -> None:
        """One request received: its time, and each rank's share (rank -> bytes,
        descriptors); a share is "a read" of the per-read histograms (with TP = 1 the one
        share)."""
        self.reads += 1
        self.read_seconds += seconds
        self.xfer_time.observe(seconds)
        for rank, (num_bytes, num_descriptors) in shares.items():
            self.read_bytes += num_bytes
            self.read_descriptors += num_descriptors
            self.rank_bytes[rank] = self.rank_bytes.get(rank, 0) + num_bytes
            self.rank_descriptors[rank] = self.rank_descriptors.get(rank, 0) + num_descriptors
            self.bytes_per_read.observe(num_bytes)
            self.descriptors_per_read.observe(num_descriptors)
