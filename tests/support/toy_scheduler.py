"""The scheduler tests' toy model runner and KV cache layouts (tests/pd/scheduling).

`ToyRunner` keeps its own copy of each request exactly as the model runner does (tokens,
block lists built only from what SchedulerOutput carries) and checks every step that
its block lists equal the KV manager's, that no request computes past its known tokens,
and that budgets hold. Its "model" picks the next token as a hash of all tokens so far,
so any scheduling mistake (lost token, double compute, wrong order) changes outputs.
"""

from __future__ import annotations

import hashlib

from pd.config import SchedulerConfig
from pd.contracts.outputs import ModelRunnerOutput, SchedulerOutput
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

BLOCK = 16
EOS = 7


def toy_next_token(tokens: list[int]) -> int:
    digest = hashlib.sha256(repr(tokens).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 500 + 10  # never EOS unless forced


class ToyRunner:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv, self.config = kv, config
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.to_fork: dict[str, int] = {}  # request -> sequences it forks into at its first token

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.blocks.pop(req_id, None)
        for new in so.new_requests:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = list(new.token_ids)
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            self.computed[new.req_id] = new.num_computed_tokens
            if new.sampling_params.n > 1 and len(new.token_ids) == new.num_prompt_tokens:
                self.to_fork[new.req_id] = new.sampling_params.n
        for cached in so.cached_requests:
            self.computed[cached.req_id] = cached.num_computed_tokens
            for ids, more in zip(self.blocks[cached.req_id], cached.new_block_ids):
                ids.extend(more)
        assert so.total_num_scheduled_tokens <= self.config.settings.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= self.config.settings.max_num_seqs
        sampled, forks = {}, {}
        for req_id, n in so.num_scheduled_tokens.items():
            assert n > 0
            live = self.kv.get_block_ids(req_id)
            # nulls replace skipped blocks in place on the manager's side; lengths and
            # every block still held must agree
            for mine, theirs in zip(self.blocks[req_id], live):
                assert len(mine) == len(theirs)
                assert all(t in (m, 0) for m, t in zip(mine, theirs))
            end = self.computed[req_id] + n
            assert end <= len(self.tokens[req_id])
            if end == len(self.tokens[req_id]):
                token = toy_next_token(self.tokens[req_id])
                self.tokens[req_id].append(token)
                sampled[req_id] = token
                if req_id in self.to_fork:  # sequences 1..n-1 start from tokens of their own
                    forks[req_id] = [token + j for j in range(1, self.to_fork.pop(req_id))]
        return ModelRunnerOutput(sampled, fork_token_ids=forks)


def attn(window=None):
    kw = dict(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float32")
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def ssm():
    return MambaSpec(block_size=BLOCK, num_heads=2, head_dim=4, state_size=4, n_groups=1, conv_width=3,
                     conv_dtype="float32", ssm_dtype="float32")


MODELS = {
    "full": [attn(), attn()],
    "gemma3": [attn(40), attn(40), attn()],
    "bamba": [ssm(), ssm(), attn()],
}


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(toy_next_token(tokens))
        tokens.append(out[-1])
    return out
