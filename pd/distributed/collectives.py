"""The collectives a sharded layer calls, on the process group `torch.distributed` was
initialised with (gloo on CPU, NCCL on CUDA); with one rank they return their input, so
a model for one device never touches `torch.distributed`.

A collective that fails (a rank died, or did not answer within the group's timeout)
raises `RankLost`: the ranks can no longer agree, so the engine stops (the model
runner contains other errors to the batch that raised them, never this one)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pd.distributed.shard import TPShard


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone or hung: the engine cannot go on."""


def all_reduce(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """The sum of `x` over the group's ranks, in place; `x` itself when alone."""
    if shard.size > 1:
        try:
            dist.all_reduce(x)
        except Exception as exc:
            raise RankLost(f"an all-reduce across {shard.size} tensor-parallel ranks failed: {exc}") from exc
    return x


def all_gather(x: torch.Tensor, shard: TPShard, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` (equal shapes) joined along `dim`, rank order."""
    if shard.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    try:
        dist.all_gather(parts, x.contiguous())
    except Exception as exc:
        raise RankLost(f"an all-gather across {shard.size} tensor-parallel ranks failed: {exc}") from exc
    return torch.cat(parts, dim=dim)
