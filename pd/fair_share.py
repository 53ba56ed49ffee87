"""How the running batch is shared between requests: max-min fair by sequences.

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

Requests with one sequence each are FIFO, and the newest is preempted first, as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pd.request import Request


def group(request: Request) -> str:
    """The client request a sequence belongs to."""
    return request.parent_id or request.request_id


def running_counts(running: Iterable[Request]) -> Counter[str]:
    return Counter(group(r) for r in running)


def next_waiting(waiting: Iterable[Request], counts: Counter[str]) -> Request:
    """Rule 1: the first waiting request of the request with the fewest sequences running."""
    return min(waiting, key=lambda r: counts[group(r)])


def growth_victim(running: Sequence[Request], counts: Counter[str]) -> Request:
    """Rule 3: the newest sequence of the request with the most sequences running."""
    most = max(counts.values())
    return next(r for r in reversed(running) if counts[group(r)] == most)


def displaced_for(request: Request, running: Sequence[Request], counts: Counter[str]) -> Request | None:
    """Rule 2: the running sequence to preempt so that `request` can run, or None when no
    request holds more than one sequence beyond what `request`'s would then hold."""
    if not running:
        return None
    victim = growth_victim(running, counts)
    if group(victim) == group(request) or counts[group(victim)] <= counts[group(request)] + 1:
        return None
    return victim
