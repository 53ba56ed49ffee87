"""The prefill servers a worker reads from: a handshake with each (off the step:
peers.py), then the NIXL agents of those of its tensor-parallel ranks this worker's rank
reads from.

A P of TP size N describes all N ranks' agents and layouts in one `HandshakeResponse`.
A worker loads only the agents holding heads it holds and no rank before gave it (a
rank with its very heads first, so whole blocks move where it can), and, on rank 0,
P's rank 0 (its lease words and notifications are rank 0's): `descriptors.piece_runs`
with one `taken` across them, as the reads later go. A response whose ranks leave some
head of this worker uncovered, or name other engines, fails the handshake.
"""

from __future__ import annotations

from collections.abc import Callable

from connectors.nixl.descriptors import piece_runs
from connectors.nixl.peer_messages import HandshakeResponse, rank_agent_name
from connectors.nixl.peers import PeerHandshakes
from connectors.nixl.stats import TransferStats
from pd.kv_transfer.params import RemotePrefillParams


class PeerAgents:
    """Known peers (engine id -> the agents to read from, in order, and its TP size), and
    what waits for a handshake under way. Not thread-safe: the engine's thread uses it."""

    def __init__(self, handshakes: PeerHandshakes, rank: int, stats: TransferStats) -> None:
        self.handshakes = handshakes
        self.rank = rank
        self.stats = stats
        self.transport = None  # the worker's NixlTransport, once its KV caches are registered
        self.agents: dict[str, list[str]] = {}
        self.ranks: dict[str, list[int]] = {}  # engine id -> the rank of each of its agents read from
        self.sizes: dict[str, int] = {}
        # engine id -> what waits for its handshake: (do it, fail it with why)
        self.waiting: dict[str, list[tuple[Callable[[], None], Callable[[str], None]]]] = {}

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self.agents

    @property
    def busy(self) -> bool:
        return bool(self.handshakes.num_pending or self.waiting)

    def when_ready(self, remote: RemotePrefillParams, action: Callable[[], None], fail: Callable[[str], None]) -> None:
        """Run `action` once the peer is known (now, or after its handshake); `fail(why)`
        instead if the handshake fails or failed a moment ago."""
        engine_id = remote.remote_engine_id
        if engine_id in self.agents:
            action()
        elif (why := self.handshakes.failed_recently(engine_id)) is not None:
            fail(why)
        elif (why := self.handshakes.start(engine_id, remote.remote_host, remote.remote_port)) is not None:
            fail(why)
        else:
            self.waiting.setdefault(engine_id, []).append((action, fail))

    def finish(self) -> None:
        """Load the agents of peers whose handshake ended; run or fail what waited."""
        for engine_id, outcome, seconds in self.handshakes.completed():
            if isinstance(outcome, HandshakeResponse):
                try:
                    self.agents[engine_id], self.ranks[engine_id] = self._load(engine_id, outcome)
                    self.sizes[engine_id] = len(outcome.agents)
                except Exception as exc:
                    outcome = exc
                    self.handshakes.mark_failed(engine_id, str(exc))
            if engine_id in self.agents:
                self.stats.handshakes += 1
                self.stats.handshake_time.observe(seconds)
            else:
                self.stats.handshake_failures += 1
            for action, fail in self.waiting.pop(engine_id, []):
                action() if engine_id in self.agents else fail(str(outcome))

    def _load(self, engine_id: str, response: HandshakeResponse) -> tuple[list[str], list[int]]:
        """The names of the agents this rank reads from, in the order the reads go, each
        loaded, and their ranks; ValueError if they hold not every head this rank holds."""
        agents = response.agents
        for rank, agent in enumerate(agents):
            if agent.layout.engine_id != rank_agent_name(engine_id, rank):
                raise ValueError(f"the side channel there belongs to engine {agent.layout.engine_id!r}, "
                                 f"not {rank_agent_name(engine_id, rank)!r}")
        ours = self.transport.pieces
        taken: list[set] = [set() for _ in ours]
        chosen = []
        for rank in sorted(range(len(agents)), key=lambda r: agents[r].layout.group_pieces != ours):
            runs = piece_runs(ours, agents[rank].layout.group_pieces, taken)
            if runs is None or any(runs) or (rank == 0 and self.rank == 0):
                chosen.append(rank)
        lacking = [(g, (p.kind, p.index)) for g, pieces in enumerate(ours) for p in pieces
                   if (p.kind, p.index) not in taken[g]]
        if lacking:
            raise ValueError(f"the ranks of {engine_id!r} hold none of the bytes of {lacking[:4]} (group, piece) "
                             f"that this rank holds")
        return [self.transport.add_peer(HandshakeResponse(agents[r].agent_metadata, agents[r].layout))
                for r in chosen], chosen

    def close(self) -> None:
        self.handshakes.close()
