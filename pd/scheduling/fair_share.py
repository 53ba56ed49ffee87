"""How the running batch and the KV pool are shared between requests.

A request asking for n sequences (or best_of) forks into n requests of its own; without a
rule, one request with n = 128 took every slot of the batch and every block of the pool,
and a 4-token request behind it waited minutes (preempted again and again as the big
one's sequences grew). The scheduler follows three rules, all counting a request's
running sequences (`group`: a sequence belongs to the request it forked from):

1. Admission: the waiting request whose request has the fewest sequences running goes
   first; among equals, the one ahead in the queue (preempted ones are put back first).
2. Room for a newcomer: when the batch is full (`max_num_seqs`) or the pool cannot take
   the request to admit, a sequence of the request with the most sequences running is
   preempted for it, as long as that request then still runs at least as many as the
   newcomer's: a request never holds more than its fair share while others wait.
3. Growth: when a running sequence needs a block and the pool has none, the newest
   sequence of the request with the most sequences running is preempted (a request that
   outgrows the pool preempts its own sequences, not others').
4. Room to grow: a request is admitted only while the pool, after it takes its blocks,
   still holds what it and every request holding blocks will grow into: the rest of their
   prompts and their next `reserve` outputs (`--reserve-growth-tokens`). With a cache that
   holds few requests, one admitted only to be preempted as the others grew was
   recomputed for nothing (a burst did its decode-side work twice).
5. A step's share: while sequences of several requests run (or wait to), a step computes
   at most as many sequences of each request as the most that any other request runs (at
   least one), those it computed least recently first; the rest keep their blocks and wait
   a step. A step's time grows with its batch, so the share of the batch a request holds
   is the share of every other request's time it costs: one request of n = 128 running
   64 sequences beside 4-token requests made theirs 1.7-2.6 times slower (the probe).
   Alone, a request runs all its sequences.

Requests with one sequence each are FIFO, and the newest is preempted first, as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pd.contracts.request import Request
from pd.kv_cache.kv_cache_manager import KVCacheManager


def group(request: Request) -> str:
    """The client request a sequence belongs to."""
    return request.parent_id or request.request_id


def running_counts(running: Iterable[Request]) -> Counter[str]:
    return Counter(group(r) for r in running)


def in_turn(waiting: Iterable[Request], counts: Counter[str]) -> list[Request]:
    """Rule 1: the waiting requests, those of the request with the fewest sequences running
    first; in their queue order among equals."""
    return sorted(waiting, key=lambda r: counts[group(r)])


def growth_victim(running: Sequence[Request], counts: Counter[str]) -> Request:
    """Rule 3: the newest sequence of the request with the most sequences running."""
    most = max(counts.values())
    return next(r for r in reversed(running) if counts[group(r)] == most)


def step_share(running: Sequence[Request], waiting: Iterable[Request] = ()) -> set[str]:
    """Rule 5: the ids of the running sequences a step may compute; a request waiting to
    be admitted counts as running one (the step admitting it is a short one too)."""
    counts = running_counts(running)
    counts.update({group(r): 1 for r in waiting if group(r) not in counts})
    if len(counts) <= 1:
        return {r.request_id for r in running}
    top = counts.most_common(2)
    chosen: set[str] = set()
    by_group: dict[str, list[Request]] = {}
    for request in running:
        by_group.setdefault(group(request), []).append(request)
    for name, sequences in by_group.items():
        cap = max(1, top[1][1] if name == top[0][0] else top[0][1])  # the most any other request runs
        chosen.update(r.request_id for r in sorted(sequences, key=lambda r: r.last_step)[:cap])
    return chosen


def displaced_for(request: Request, running: Sequence[Request], counts: Counter[str]) -> Request | None:
    """Rule 2: the running sequence to preempt so that `request` can run, or None when no
    request holds more than one sequence beyond what `request`'s would then hold."""
    if not running:
        return None
    victim = growth_victim(running, counts)
    if group(victim) == group(request) or counts[group(victim)] <= counts[group(request)] + 1:
        return None
    return victim


def room_to_grow(kv: KVCacheManager, holders: Sequence[Request], request: Request, num_tokens_held: int,
                 num_blocks_now: int, reserve: int, max_model_len: int) -> bool:
    """Rule 4: whether `request`, taking `num_blocks_now` blocks to hold `num_tokens_held`
    tokens, leaves room for `holders` (the requests holding blocks) and itself to grow.
    Always true with `reserve` 0 or nobody holding blocks (a lone request always runs)."""
    if not reserve or not holders:
        return True
    growth = kv.growth_blocks(_to_grow(request, num_tokens_held, reserve, max_model_len))
    growth += sum(kv.growth_blocks(_to_grow(r, r.num_computed_tokens, reserve, max_model_len)) for r in holders)
    return num_blocks_now + growth <= kv.num_free_blocks


def _to_grow(request: Request, num_tokens_held: int, reserve: int, max_model_len: int) -> int:
    """The tokens a request holding `num_tokens_held` has yet to hold: the rest of its known
    tokens, and of its outputs to come (its budget, its context) `reserve` at most."""
    outputs = request.sampling_params.max_tokens - len(request.output_token_ids)
    outputs = max(0, min(outputs, max_model_len - request.num_tokens, reserve))
    return max(0, request.num_tokens - num_tokens_held) + outputs
