"""The fixed costs a live deployment adds to the engine's steps, measured on an idle
one (`pd bench simulate fit --live`): one request at a time, so that nothing queues.

Two deployments of pd bench fleet (`colocated` and `1p1d`, `--num-threads 1` servers):
- colocated, `--requests` prompts of `PROMPT` tokens and `OUTPUT` tokens each: the TTFT
  beyond the engine's one prefill step is four HTTP legs in the simulator's model
  (client to proxy to server, and the first token back), so `hop_s` is a quarter of it;
  the TPOT beyond a decode step of one is what the server's engine loop adds to each
  step (`loop_s`: sending the step's outputs out of the engine process);
- 1p1d, the same requests: the TTFT beyond P's prefill step and six legs (to P, back,
  to D, and the first token back) is the KV read's fixed part (`transfer_fixed_s`,
  after its bytes at the given rate).
Medians over the requests; a figure that comes out negative is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import httpx

from benchmarks import fleet, serve
from benchmarks.datasets import random_dataset
from benchmarks.sim.costs import StepCosts, attention_of

PROMPT, OUTPUT = 64, 33


async def _timed(proxy: str, count: int) -> list:
    samples = random_dataset(count + 2, PROMPT, OUTPUT, 0, 32000, 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        model = await serve.first_model(client, proxy)
        payloads = [serve.build_payload("/v1/completions", model, s, ignore_eos=True) for s in samples]
        records, _ = await serve.run_requests(client, f"{proxy}/v1/completions", payloads, samples,
                                              [0.0] * len(samples), 1, label="probe")
    return [r for r in records[2:] if r.success]  # the first two warm the servers


def measure(model: str, count: int, server_args: str) -> dict[str, dict[str, float]]:
    """Per deployment: the median TTFT and TPOT of requests sent one at a time."""
    import launch

    launch.deployment_secret()
    args = argparse.Namespace(servers=2, model=Path(model), server_args=server_args)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in ("colocated", "1p1d"):
            with fleet.deployment(config, args, Path(tmp)) as proxy:
                records = asyncio.run(_timed(proxy, count))
            out[config] = {"ttft_s": statistics.median(r.ttft for r in records),
                           "tpot_s": statistics.median(r.tpot for r in records)}
    return out


def fixed_costs(costs: StepCosts, live: dict[str, dict[str, float]]) -> dict[str, float]:
    """hop_s, loop_s and transfer_fixed_s from the idle deployments' figures (`costs`
    with loop_s 0: the engine's own steps)."""
    loop = max(0.0, live["colocated"]["tpot_s"] - costs.decode_step_s(1, PROMPT + OUTPUT / 2))
    prefill = costs.step_s(PROMPT, attention_of(PROMPT, 0), 1) + loop
    hop = max(0.0, (live["colocated"]["ttft_s"] - prefill) / 4)
    read = live["1p1d"]["ttft_s"] - prefill - 6 * hop - PROMPT * costs.kv_bytes_per_token / costs.transfer_bytes_per_s
    return {"hop_s": hop, "loop_s": loop, "transfer_fixed_s": max(0.0, read)}
