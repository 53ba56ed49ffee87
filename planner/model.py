"""What a split of the fleet into prefill and decode servers would give: TTFT and TPOT at a
percentile, predicted from the load and the servers' measured costs, the time requests
wait in queues included.

Prefill. The prefill servers together compute `prefill_tokens_per_s` prompt tokens per
second each; requests arrive at `arrival_rate` with `prompt_tokens` to compute. The pool
is a queue served at `n x rate` (M/M/1 on the pooled rate, utilization `rho`): a new
request waits for what is queued now (`queued_prompt_tokens / (n x rate)`, the backlog a
burst left) or, in steady state, the M/M/1 waiting time at the percentile,
`ln(rho / (1 - p)) / ((1 - rho) x n x rate / prompt_tokens)` (0 when `rho <= 1 - p`),
whichever is longer; then its own prompt on one server, then the KV read. At `rho >= 1`
the queue grows without bound: TTFT is infinite.

Decode. A decode step of batch b takes `decode_step_s + decode_step_per_seq_s x b`.
Requests decode for `output_tokens` steps, so by Little's law the sequences in flight are
`arrival_rate x output_tokens x TPOT`, spread over n decode servers: the fixed point is
`TPOT = a / (1 - k x arrival_rate x output_tokens / n)` (infinite past 1), and never less
than what the batches running now take. A decode step holds no prefill chunk here, so
its time varies little: the percentile is the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf
OVERLOADED = 1000.0  # the score of a split that cannot keep up, per unit of its worse utilization


@dataclass(frozen=True)
class Costs:
    """One server's costs: measured by the planner (observe.py) or given as priors."""

    prefill_tokens_per_s: float  # prompt tokens a prefill server computes per second
    decode_step_s: float  # a decode step's fixed part
    decode_step_per_seq_s: float  # what each sequence of the batch adds to a step
    transfer_s: float = 0.0  # the KV read of a request's prompt, D from P


@dataclass(frozen=True)
class Load:
    arrival_rate: float  # requests per second
    prompt_tokens: float  # prompt tokens a request has computed (its prefix-cache hits aside), mean
    output_tokens: float  # tokens a request generates, mean
    queued_prompt_tokens: float = 0.0  # prompt tokens queued or being computed on prefill servers now
    running_decodes: float = 0.0  # sequences being decoded now, all decode servers


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    prefill_utilization: float  # of the prefill pool: >= 1 is a queue that only grows
    decode_utilization: float  # step time the arrivals add per step time: >= 1 likewise
    decode_batch: float  # sequences per decode server

    def score(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """The worse of the two against its SLO: <= 1 meets both. A split that cannot keep
        up scores OVERLOADED x its worse utilization (so that the least overloaded is best)."""
        if math.isinf(self.ttft_s) or math.isinf(self.tpot_s):
            return OVERLOADED * max(self.prefill_utilization, self.decode_utilization)
        return max(self.ttft_s / ttft_slo_s, self.tpot_s / tpot_slo_s)

    def inputs(self) -> dict[str, float]:
        return {"ttft_s": _round(self.ttft_s, 4), "tpot_s": _round(self.tpot_s, 5),
                "prefill_utilization": _round(self.prefill_utilization, 3),
                "decode_utilization": _round(self.decode_utilization, 3), "decode_batch": _round(self.decode_batch, 2)}


def _round(value: float, digits: int) -> float | str:
    return "inf" if math.isinf(value) else round(value, digits)  # JSON has no infinity


def predict(n_prefill: int, n_decode: int, load: Load, costs: Costs, percentile: float) -> Prediction:
    """TTFT (at `percentile`, 0-1) and TPOT of `n_prefill` prefill and `n_decode` decode servers."""
    ttft, rho = prefill_ttft(n_prefill, load, costs, percentile)
    tpot, demand, batch = decode_tpot(n_decode, load, costs)
    return Prediction(ttft, tpot, rho, demand, batch)


def prefill_ttft(n: int, load: Load, costs: Costs, percentile: float) -> tuple[float, float]:
    if n <= 0 or costs.prefill_tokens_per_s <= 0:
        return INF, INF  # (TTFT, utilization)
    pooled = n * costs.prefill_tokens_per_s
    prompt = max(load.prompt_tokens, 1.0)
    rho = load.arrival_rate * prompt / pooled
    if rho >= 1:
        return INF, rho
    backlog = load.queued_prompt_tokens / pooled
    waiting = 0.0
    if rho > 1 - percentile:
        waiting = math.log(rho / (1 - percentile)) / ((1 - rho) * pooled / prompt)
    return max(backlog, waiting) + prompt / costs.prefill_tokens_per_s + costs.transfer_s, rho


def decode_tpot(n: int, load: Load, costs: Costs) -> tuple[float, float, float]:
    """(TPOT, utilization, batch per server)."""
    if n <= 0:
        return INF, INF, INF
    a, k = costs.decode_step_s, costs.decode_step_per_seq_s
    demand = k * load.arrival_rate * load.output_tokens / n  # step seconds added per step second
    if demand >= 1:
        return INF, demand, INF
    steady = a / (1 - demand)
    batch = max(load.arrival_rate * load.output_tokens * steady, load.running_decodes) / n
    return max(steady, a + k * batch), demand, batch
