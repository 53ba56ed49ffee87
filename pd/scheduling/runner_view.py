"""What the model runner holds of each request, as the scheduler has told it.

The runner keeps a request between steps (outputs.py), so a request it does not hold goes
out whole (`NewRequestData`: every token and block: admitted, readmitted after preemption,
or a sequence forked since the last step), one it holds with only the blocks added since
(`CachedRequestData`). A request preempted or finished is forgotten here when the runner
is told to drop it.
"""

from __future__ import annotations

from pd.contracts.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pd.contracts.request import Request
from pd.kv_cache.kv_cache_manager import KVCacheManager


class RunnerView:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv = kv_cache_manager
        self._sent: dict[str, list[int]] = {}  # request id -> per group, how many of its block ids the runner has

    def schedule(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """`num_new` tokens of the request in this step, with what the runner lacks of it."""
        req_id = request.request_id
        block_ids = self.kv.get_block_ids(req_id)
        sent = self._sent.get(req_id)
        self._sent[req_id] = [len(ids) for ids in block_ids]
        if sent is None:
            out.new_requests.append(NewRequestData(req_id, request.all_token_ids, request.num_prompt_tokens,
                                                   request.sampling_params, block_ids, request.num_computed_tokens))
        else:
            out.cached_requests.append(CachedRequestData(req_id, [ids[n:] for ids, n in zip(block_ids, sent)],
                                                         request.num_computed_tokens))
        out.num_scheduled_tokens[req_id] = num_new

    def forget(self, req_id: str) -> None:
        self._sent.pop(req_id, None)
