"""The planner in the simulation: the real `pd planner` pieces, fed from the simulated
fleet as they are fed from a live one.

`SimObserver` is planner/observe.py's `Observer` with its two HTTP reads answered by the
simulation: `GET /admin/instances` by the simulated proxy's `admin_state()`, each
server's /metrics by its engine's counters written as the Prometheus lines the observer
reads (`SAMPLES`); everything else (differences between ticks, the exponentially
weighted rates, the decode step's fit, the priors) is the observer's own, on the
simulation's clock. The `Planner` (planner/policy.py) is built from `pd planner`'s own
flags (`--planner-args`) and decides on what the observer hands it.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.sim.engine import SimEngine
from benchmarks.sim.proxy import SimProxy
from planner.model import Costs
from planner.observe import SAMPLES, Observer
from planner.policy import Planner, Slo


def metrics_text(engine: SimEngine) -> str:
    """The engine's figures as a server's /metrics has them (only those the planner reads)."""
    values = vars(engine.counters) | {"running": float(len(engine.running))}
    lines = []
    for name, (attribute, label) in SAMPLES.items():
        labels = f'{{{label[0]}="{label[1]}"}}' if label else ""
        lines.append(f"{name}{labels} {values[attribute]!r}")
    return "\n".join(lines) + "\n"


@dataclass
class SimObserver(Observer):
    proxy: SimProxy | None = None
    engines: dict[str, SimEngine] = field(default_factory=dict)

    def _admin(self, path: str) -> dict:
        return self.proxy.admin_state()

    def _metrics(self, url: str) -> str:
        return metrics_text(self.engines[url])


def planner_args(text: str, ttft_slo: float, tpot_slo: float) -> argparse.Namespace:
    """`pd planner`'s flags as it would parse them (`--planner-args`, the SLOs)."""
    from planner.main import add_planner_flags

    parser = argparse.ArgumentParser(prog="pd planner (simulated)")
    add_planner_flags(parser)
    return parser.parse_args(["--proxy", "simulated", "--admin-key", "simulated", "--ttft-slo", str(ttft_slo),
                              "--tpot-slo", str(tpot_slo), *shlex.split(text)])


def build(args: argparse.Namespace, proxy: SimProxy, engines: dict[str, SimEngine],
          clock: Callable[[], float]) -> tuple[SimObserver, Planner]:
    """The observer and the planner, as `pd planner` builds them from `args`."""
    priors = Costs(args.prefill_tokens_per_s, args.decode_step, args.decode_step_per_seq)
    observer = SimObserver("simulated", "simulated", priors, clock=clock, load_window_s=args.load_window, proxy=proxy,
                           engines=engines)
    planner = Planner(Slo(args.ttft_slo, args.tpot_slo, args.percentile / 100), args.patience, args.cooldown,
                      args.margin, clock=clock, max_move=args.max_move)
    return observer, planner
