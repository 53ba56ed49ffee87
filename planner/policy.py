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
and then it moves one server, the least loaded of the role it takes from: one step at a
time, each re-judged. Every decision says why, with its inputs.
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
class Decision:
    action: str  # "switch" (move `url` to `role`), "hold" (wants to, not yet), "keep"
    reason: str
    url: str | None = None
    role: str | None = None
    inputs: dict = field(default_factory=dict)


@dataclass
class Planner:
    slo: Slo
    patience: int = 2  # ticks in a row wanting the same move
    cooldown_s: float = 10.0  # after a move, before the next
    margin: float = 0.2  # a split meeting the SLO is left only for one scoring this much better
    clock: Callable[[], float] = time.monotonic
    _wanted: int = 0  # +1 more prefill, -1 more decode
    _streak: int = 0
    _moved_at: float = float("-inf")

    def decide(self, members: list[Member], load: Load, costs: Costs) -> Decision:
        taking = [m for m in members if not m.draining]
        now_p = sum(m.role == "prefill" for m in taking)
        splits = self._splits(taking)
        if not splits or now_p not in splits:
            self._streak = 0
            return Decision("keep", "no split to choose from (no server that switches, or a role without any)")
        scored = {p: predict(p, len(taking) - p, load, costs, self.slo.percentile) for p in splits}
        score = {p: prediction.score(self.slo.ttft_s, self.slo.tpot_s) for p, prediction in scored.items()}
        best = min(splits, key=lambda p: (score[p], abs(p - now_p)))
        inputs = self._inputs(load, costs, scored, now_p, len(taking))
        worth = score[best] < score[now_p] if score[now_p] > 1 else score[best] < score[now_p] * (1 - self.margin)
        if best == now_p or not worth:
            self._streak = 0
            return Decision("keep", f"{_split(now_p, len(taking))} scores {score[now_p]:.2f} against the SLO; "
                                    f"no split is better enough", inputs=inputs)
        direction = 1 if best > now_p else -1
        self._streak = self._streak + 1 if direction == self._wanted else 1
        self._wanted = direction
        why = (f"{_split(now_p, len(taking))} scores {score[now_p]:.2f} ({_figures(scored[now_p], self.slo)}); "
               f"{_split(best, len(taking))} scores {score[best]:.2f} ({_figures(scored[best], self.slo)})")
        if self._streak < self.patience:
            return Decision("hold", f"{why}; wanted {self._streak} of {self.patience} ticks", inputs=inputs)
        if self.clock() - self._moved_at < self.cooldown_s:
            return Decision("hold", f"{why}; cooling down after the last move", inputs=inputs)
        giving = "decode" if direction > 0 else "prefill"
        moved = min((m for m in taking if m.role == giving and m.switchable), key=lambda m: m.in_flight)
        self._moved_at, self._streak = self.clock(), 0
        return Decision("switch", why, moved.url, "prefill" if direction > 0 else "decode", inputs)

    @staticmethod
    def _splits(taking: list[Member]) -> list[int]:
        """The prefill server counts reachable by switching roles, one server left per role."""
        fixed_p = sum(m.role == "prefill" and not m.switchable for m in taking)
        fixed_d = sum(m.role == "decode" and not m.switchable for m in taking)
        free = len(taking) - fixed_p - fixed_d
        return [p for p in range(fixed_p, fixed_p + free + 1) if p >= 1 and len(taking) - p >= 1 and
                len(taking) - p >= fixed_d]

    def _inputs(self, load: Load, costs: Costs, scored: dict[int, Prediction], now_p: int, n: int) -> dict:
        return {"load": {k: round(v, 4) for k, v in vars(load).items()},
                "costs": {k: round(v, 6) for k, v in vars(costs).items()},
                "now": _split(now_p, n), "splits": {_split(p, n): pred.inputs() for p, pred in scored.items()}}


def _split(p: int, n: int) -> str:
    return f"{p}P{n - p}D"


def _figures(prediction: Prediction, slo: Slo) -> str:
    return (f"TTFT p{slo.percentile * 100:g} {prediction.ttft_s:.3g} s vs {slo.ttft_s:g}, "
            f"TPOT {prediction.tpot_s * 1000:.3g} ms vs {slo.tpot_s * 1000:g}")
