"""What the NIXL connector counts, for /metrics: cumulative counters and fixed-bucket
histograms (named after vLLM's nixl_* metrics, under pd_kv_transfer_*)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd.histogram import BYTES_BUCKETS, COUNT_BUCKETS, SECONDS_BUCKETS, Histogram


@dataclass
class TransferStats:
    """Cumulative figures: counters, and histograms per completed read (its time from
    post to completion, the time posting it took, its bytes and descriptors: with tensor
    parallelism each decode rank's share of a request) and per handshake."""

    path: str = ""  # what the bytes read cross, as UCX is configured (connectors/nixl/ucx.py `path`)
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
    stranger_notifications: int = 0  # NIXL notifications from agents the side channel never answered
    handshakes_refused: int = 0  # side-channel handshakes refused: not from a peer (SideChannelServer.refused)
    digests_checked: int = 0  # requests received whose bytes matched the holder's digests
    digest_mismatches: int = 0  # requests received whose bytes did not: a load failure
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
