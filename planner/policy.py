"""The planner's decisions: which split of the fleet into prefill and decode servers, and
when to move one server toward it.

Each tick the planner scores every split it can reach by switching roles (`model.py`:
the worse of TTFT and TPOT against their SLOs; the servers with one role stay as they
are, and at least one server is left in each role) and compares the best with the split
now. It moves toward the best only when
- the split now misses the SLO and the best scores better, or it meets it and the best
  scores better by more than `margin` (so that it does not chase noise);
- it has wanted the same direction for `patience` ticks in a row (a burst that is over
  in a tick moves nothing);
- `cooldown_s` has passed since its last move (the move's effect shows first);
and then it moves half the way to the best split (rounded up; at most `max_move` servers,
a quarter of the fleet by default): the least loaded servers of the role it takes from.
A small fleet moves one server at a time, each move re-judged; a large one crosses ten
servers' distance in four moves rather than ten cool-downs. Every decision says why, with
its inputs.

With `Scaling` (a launcher to start and stop servers, `pd planner --launcher`) the fleet
may also grow or shrink by one server, within `min_instances` and `max_instances`:
- a fleet missing the SLO takes the split, of its size or one more, that meets it
  (switching before adding: a switch costs nothing) or, when none does, scores best, the
  smaller fleet on a tie: so it adds a server of the role that split has more of;
- a fleet meeting the SLO gives back a server it started (`Member.stoppable`) when one
  fewer still scores `margin` under the SLO, and has for `scale_down_after_s` without a
  break (a lull between arrivals is no reason to stop a server it will want back a
  second later), and no server it started is still starting (the fleet's size is in
  flux until it has joined, and stopping one for it undoes the start): the least loaded
  of the role whose removal scores best. Its drain comes first (planner/launchers.py).
The same patience and cool-down apply; an add or a remove is one server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.model import Costs, Load, Prediction, predict

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Member:
    """A server as the proxy's admin API lists it."""

    url: str
    role: str
    roles: tuple[str, ...]
    in_flight: int = 0
    draining: bool = False
    stoppable: bool = False  # the planner's launcher started it, and may stop it
    starting: bool = False  # the launcher started it and it has not joined yet: counted, never moved

    @property
    def switchable(self) -> bool:
        return set(ROLES) <= set(self.roles)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    percentile: float  # 0-1: the TTFT percentile the SLO is about

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or not 0 < self.percentile < 1:
            raise ValueError(f"the SLOs must be positive and the percentile within 0 and 100, got {self}")


@dataclass(frozen=True)
class Scaling:
    """How far the planner may grow and shrink the fleet (it counts every server taking
    requests, those it did not start included)."""

    min_instances: int
    max_instances: int

    def __post_init__(self) -> None:
        if not 2 <= self.min_instances <= self.max_instances:
            raise ValueError(f"the fleet needs 2 <= min instances <= max instances, got {self.min_instances} and "
                             f"{self.max_instances}")


@dataclass(frozen=True)
class Decision:
    action: str  # "switch" (move `urls` to `role`), "add" (start a server for `role`), "remove" (stop `urls`),
    #              "hold" (wants to, not yet), "keep"
    reason: str
    urls: tuple[str, ...] = ()
    role: str | None = None
    inputs: dict = field(default_factory=dict)

    @property
    def url(self) -> str | None:
        """The first server moved (the only one, but for a switch of several)."""
        return self.urls[0] if self.urls else None


Split = tuple[int, int]  # (servers, prefill servers among them)


@dataclass
class Planner:
    slo: Slo
    patience: int = 2  # ticks in a row wanting the same move
    cooldown_s: float = 10.0  # after a move, before the next
    margin: float = 0.2  # a split meeting the SLO is left only for one scoring this much better
    clock: Callable[[], float] = time.monotonic
    scaling: Scaling | None = None  # None: the fleet's size is not the planner's to change
    max_move: int | None = None  # servers one switch may move; None: a quarter of the fleet, at least 1
    scale_down_after_s: float = 30.0  # a remove must have been wanted this long without a break
    _wanted: tuple[str, str] | None = None  # (action, role) of the move wanted lately
    _streak: int = 0
    _wanted_since: float = 0.0  # when the streak began
    _moved_at: float = float("-inf")

    def decide(self, members: list[Member], load: Load, costs: Costs) -> Decision:
        taking = [m for m in members if not m.draining]
        n, now_p = len(taking), sum(m.role == "prefill" for m in taking)
        splits = self._splits(taking)
        if not splits or now_p not in splits:
            self._streak = 0
            return Decision("keep", "no split to choose from (no server that switches, or a role without any)")
        options = [(n, p) for p in splits] + self._resized(taking, now_p)
        scored = {k: predict(k[1], k[0] - k[1], load, costs, self.slo.percentile) for k in options}
        score = {k: prediction.score(self.slo.ttft_s, self.slo.tpot_s) for k, prediction in scored.items()}
        now = (n, now_p)
        target, worth = self._target(now, score)
        inputs = self._inputs(load, costs, scored, now)
        if target == now or not worth:
            self._streak = 0
            return Decision("keep", f"{_split(*now)} scores {score[now]:.2f} against the SLO; "
                                    f"no split is better enough", inputs=inputs)
        move = _move(now, target)
        self._streak = self._streak + 1 if move == self._wanted else 1
        if self._streak == 1:
            self._wanted_since = self.clock()
        self._wanted = move
        why = (f"{_split(*now)} scores {score[now]:.2f} ({_figures(scored[now], self.slo)}); "
               f"{_split(*target)} scores {score[target]:.2f} ({_figures(scored[target], self.slo)})")
        if self._streak < self.patience:
            return Decision("hold", f"{why}; wanted {self._streak} of {self.patience} ticks", inputs=inputs)
        if self.clock() - self._moved_at < self.cooldown_s:
            return Decision("hold", f"{why}; cooling down after the last move", inputs=inputs)
        if move[0] == "remove" and self.clock() - self._wanted_since < self.scale_down_after_s:
            return Decision("hold", f"{why}; a server is stopped only once fewer have been enough for "
                                    f"{self.scale_down_after_s:g} s", inputs=inputs)
        self._moved_at, self._streak = self.clock(), 0
        action, role = move
        if action == "add":
            return Decision("add", why, (), role, inputs)
        if action == "remove":
            stopped = min((m for m in taking if m.role == role and m.stoppable), key=lambda m: m.in_flight)
            return Decision("remove", why, (stopped.url,), role, inputs)
        giving = "decode" if role == "prefill" else "prefill"
        count = min(-(-abs(target[1] - now[1]) // 2), self.max_move or max(1, n // 4))
        moved = sorted((m for m in taking if m.role == giving and m.switchable), key=lambda m: m.in_flight)[:count]
        return Decision("switch", why, tuple(m.url for m in moved), role, inputs)

    def _target(self, now: Split, score: dict[Split, float]) -> tuple[Split, bool]:
        """The split to move toward, and whether it is worth a move."""
        if score[now] > 1:  # missing the SLO: the split meeting it with the fewest servers and moves, else the best
            target = min((k for k in score if k[0] >= now[0]),
                         key=lambda k: (max(score[k], 1.0), k[0], score[k], abs(k[1] - now[1])))
            return target, score[target] < score[now]
        fewer = [k for k in score if k[0] < now[0] and score[k] <= 1 - self.margin]
        if fewer:  # meeting it with room to spare: one server fewer would still meet it
            return min(fewer, key=lambda k: score[k]), True
        target = min((k for k in score if k[0] == now[0]), key=lambda k: (score[k], abs(k[1] - now[1])))
        return target, score[target] < score[now] * (1 - self.margin)

    def _resized(self, taking: list[Member], now_p: int) -> list[Split]:
        """The splits one server more (of either role) or one fewer (one the planner
        started, none while one it started is still starting) reach, within the scaling
        bounds; none without scaling."""
        if self.scaling is None:
            return []
        n, out = len(taking), []
        if n < self.scaling.max_instances:
            out += [(n + 1, now_p + 1), (n + 1, now_p)]
        if n > self.scaling.min_instances and not any(m.starting for m in taking):
            for role in {m.role for m in taking if m.stoppable}:
                p = now_p - (role == "prefill")
                if p >= 1 and n - 1 - p >= 1:
                    out.append((n - 1, p))
        return out

    @staticmethod
    def _splits(taking: list[Member]) -> list[int]:
        """The prefill server counts reachable by switching roles, one server left per role."""
        fixed_p = sum(m.role == "prefill" and not m.switchable for m in taking)
        fixed_d = sum(m.role == "decode" and not m.switchable for m in taking)
        free = len(taking) - fixed_p - fixed_d
        return [p for p in range(fixed_p, fixed_p + free + 1) if p >= 1 and len(taking) - p >= 1 and
                len(taking) - p >= fixed_d]

    def _inputs(self, load: Load, costs: Costs, scored: dict[Split, Prediction], now: Split) -> dict:
        return {"load": {k: round(v, 4) for k, v in vars(load).items()},
                "costs": {k: round(v, 6) for k, v in vars(costs).items()},
                "now": _split(*now), "splits": {_split(*k): pred.inputs() for k, pred in scored.items()}}


def _move(now: Split, target: Split) -> tuple[str, str]:
    """The one-server move from `now` toward `target`: (action, role)."""
    if target[0] > now[0]:
        return "add", "prefill" if target[1] > now[1] else "decode"
    if target[0] < now[0]:
        return "remove", "prefill" if target[1] < now[1] else "decode"
    return "switch", "prefill" if target[1] > now[1] else "decode"


def _split(n: int, p: int) -> str:
    return f"{p}P{n - p}D"


def _figures(prediction: Prediction, slo: Slo) -> str:
    return (f"TTFT p{slo.percentile * 100:g} {prediction.ttft_s:.3g} s vs {slo.ttft_s:g}, "
            f"TPOT {prediction.tpot_s * 1000:.3g} ms vs {slo.tpot_s * 1000:g}")
