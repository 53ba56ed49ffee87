"""Sampling penalties computed the slow way, one vocabulary entry at a time: the reference
for the sampler."""

from __future__ import annotations

import torch


def brute_force_penalized(x: torch.Tensor, tokens: list[int], num_prompt: int, presence: float, frequency: float,
                          repetition: float) -> torch.Tensor:
    """The penalties one vocabulary entry at a time, in float64."""
    row = x.double().clone()
    outputs = tokens[num_prompt:]
    for v in range(row.shape[0]):
        if v in tokens and repetition != 1.0:
            row[v] = row[v] / repetition if row[v] > 0 else row[v] * repetition
        if v in outputs:
            row[v] -= frequency * outputs.count(v) + presence
    return row
