"""Fixed-bucket histograms for /metrics, filled where the work happens (a connector, an
offload tier) and sent to the server as `HistogramSnapshot`s."""

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
