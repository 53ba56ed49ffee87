"""Log-probabilities of tokens, from a model's logits.

Prompt tokens are scored from the model's logits; sampled tokens from the logits they
were chosen from (pd/logprobs.py says which). Prompt positions are computed a few rows
at a time, so a long prompt never holds a vocabulary-wide float32 row for every position
at once.
"""

from __future__ import annotations

import torch

from pd.logprobs import LOGPROB_FLOOR, Logprobs, PromptLogprobs
from pd.models.base import CausalLM

ROWS_PER_CHUNK = 64  # 64 rows x 262,144 vocab x 4 bytes = 64 MiB of logits at a time


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, V) float32, token_ids (N,) -> (ids (N, 1+k), logprobs (N, 1+k),
    ranks (N,)): column 0 is the given token, columns 1.. the k most likely, most likely
    first; ranks are the given token's (1 = most likely; ties share the better rank).
    A logprob of -inf (a token masked out) is LOGPROB_FLOOR."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(k, dim=-1)
    values = torch.cat((chosen, top.values), 1).clamp(min=LOGPROB_FLOOR)
    return torch.cat((token_ids[:, None], top.indices), 1), values, ranks


def prompt_logprobs(model: CausalLM, hidden: torch.Tensor, next_ids: list[int], k: int,
                    start: int) -> PromptLogprobs:
    """`hidden` (N, H): the final hidden states of prompt positions start-1 .. start+N-2;
    `next_ids`: the prompt tokens at start .. start+N-1, each scored by the row before it."""
    targets = torch.tensor(next_ids, dtype=torch.int64, device=hidden.device)
    ids, values, ranks = [], [], []
    for lo in range(0, hidden.shape[0], ROWS_PER_CHUNK):
        rows = slice(lo, lo + ROWS_PER_CHUNK)
        chunk = token_logprobs(model.compute_logits(hidden[rows]), targets[rows], k)
        ids.append(chunk[0]), values.append(chunk[1]), ranks.append(chunk[2])
    return PromptLogprobs(torch.cat(ids).tolist(), torch.cat(values).tolist(), torch.cat(ranks).tolist(), start=start)


def sampled_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> Logprobs:
    """One row per row of `logits` (N, V): the sampled `token_ids[i]` scored, with the
    `ks[i]` most likely tokens there."""
    targets = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    ids, values, ranks = token_logprobs(logits, targets, max(ks))
    return Logprobs([row[:1 + k] for row, k in zip(ids.tolist(), ks)],
                    [row[:1 + k] for row, k in zip(values.tolist(), ks)], ranks.tolist())
