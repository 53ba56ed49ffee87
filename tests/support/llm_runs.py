"""Prompts through `pd.LLM`: each request's tokens and its logits step by step, and the
comparison of two such runs."""

from __future__ import annotations

from pathlib import Path

import torch

from pd import LLM
from pd.contracts.sampling_params import SamplingParams

Run = tuple[list[list[int]], list[list[torch.Tensor]]]


def llm_run(model: Path, prompts: list[list[int]], params: SamplingParams, **engine_args) -> Run:
    """Each prompt's tokens, and its logits (one float32 row per sampled token, on the CPU)."""
    with LLM(str(model), keep_logits=True, **engine_args) as llm:
        outputs = llm.generate(prompts, params)
    return [o.token_ids for o in outputs], [[row.cpu() for row in o.logits] for o in outputs]


def assert_logits_close(want: list[list[torch.Tensor]], got: list[list[torch.Tensor]], tol: float) -> None:
    """Request by request, step by step, every logit within `tol`."""
    assert len(want) == len(got)
    for want_rows, got_rows in zip(want, got):
        assert want_rows and len(want_rows) == len(got_rows)
        for w, g in zip(want_rows, got_rows):
            assert (w - g).abs().max().item() <= tol
