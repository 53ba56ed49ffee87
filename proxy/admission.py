"""The proxy's queue: requests it cannot place yet wait here, in order, within bounds.

A request has no room when every decode server is at `--max-outstanding`, or every
prefill server answered 503 `kv_held_limit` (it keeps too many blocks for requests no
decode server has read yet). Instead of answering the client, the proxy queues it and
tries again as room frees up: a request that ended, a decode opened (its prefill
server's blocks are read and freed), a prefill answered. Only past the queue's bounds
does the client get 429 with Retry-After: `--max-queue` requests waiting
(`queue_full`), or one waiting longer than `--queue-timeout` (`queue_timeout`).

Order: by the body's `priority` (lower first, as vLLM's; default 0), then arrival. While
the queue is blocked (the last try found no room), only its head tries again, on each
change or after `retry_after_s`; the others wait behind it, so a burst does not hammer
full servers. A try that places its request opens the queue: the requests behind it go
as fast as room allows. A request that arrives while others wait queues behind them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_RETRY_AFTER_S = 1.0  # a blocked head tries again after this long without a change


class QueueFull(Exception):
    """`--max-queue` requests wait already."""


class QueueTimeout(Exception):
    """The request waited `--queue-timeout` without room."""


@dataclass(order=True)
class Ticket:
    priority: int
    seq: int
    deadline: float = field(compare=False)
    queued: bool = field(default=False, compare=False)  # it has waited in line: back after a try, it keeps its place
    changes: int = field(default=0, compare=False)  # the changes seen when its try began


class Admission:
    """The queue of one proxy. `max_queue == 0`: no queue (no room is answered at once)."""

    def __init__(self, max_queue: int, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.clock = clock
        self._waiting: list[Ticket] = []  # a heap
        self._seq = itertools.count()
        self._blocked = False  # the last try found no room
        self._blocked_changes = 0  # the changes seen when it did
        self._retry_at = 0.0  # when the head tries again without a change
        self._changes = 0
        self._changed = asyncio.Condition()
        self._notifying: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.max_queue > 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def ticket(self, priority: int = 0) -> Ticket:
        """A place in line, for a request's turns."""
        return Ticket(priority, next(self._seq), self.clock() + self.timeout_s, changes=self._changes)

    async def turn(self, ticket: Ticket) -> None:
        """Wait until the ticket may try to place its request: nobody ahead of it, and the
        queue open (or, blocked, a change or the retry time since the last try, which this
        try then uses up); QueueFull when it would be the `max_queue + 1`-th to wait (a
        ticket back after a try keeps its place), QueueTimeout past its deadline (it then
        leaves the queue)."""
        ticket.changes = self._changes
        if not self._waiting and not self._blocked:
            return
        if not ticket.queued and len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests wait for room already (--max-queue)")
        ticket.queued = True
        heapq.heappush(self._waiting, ticket)
        try:
            async with self._changed:
                while not self._may_go(ticket):
                    left = ticket.deadline - self.clock()
                    if left <= 0:
                        raise QueueTimeout(f"no room for the request within {self.timeout_s:g} s (--queue-timeout)")
                    head = self._waiting[0] is ticket  # only the head waits for the retry time too
                    wait = min(left, max(0.0, self._retry_at - self.clock())) if self._blocked and head else left
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=wait)
                    except asyncio.TimeoutError:
                        pass
            ticket.changes = self._changes
            if self._blocked:  # a retry: the next one waits for the change after it
                self._blocked_changes = self._changes
                self._retry_at = self.clock() + DEFAULT_RETRY_AFTER_S
        finally:
            self._waiting.remove(ticket)
            heapq.heapify(self._waiting)
            self._notify_soon()  # the next in line may go now

    def _may_go(self, ticket: Ticket) -> bool:
        if self._waiting[0] is not ticket:
            return False
        return not self._blocked or self._changes > self._blocked_changes or self.clock() >= self._retry_at

    def no_room(self, ticket: Ticket, retry_after_s: float | None = None) -> None:
        """The ticket's try found no room: the queue is blocked; its head tries again at
        the next change (one during the try counts: it may have made room), or after
        `retry_after_s`. (The request then takes a new turn: its ticket keeps its place
        in line.)"""
        self._blocked = True
        self._blocked_changes = ticket.changes
        self._retry_at = self.clock() + (retry_after_s if retry_after_s is not None else DEFAULT_RETRY_AFTER_S)

    def placed(self) -> None:
        """A try placed its request: the queue is open again."""
        if self._blocked:
            self._blocked = False
            self.changed()

    def changed(self) -> None:
        """Room may have freed up (a request ended, a decode opened, a prefill answered)."""
        self._changes += 1
        self._notify_soon()

    def _notify_soon(self) -> None:
        if self._waiting:
            task = asyncio.get_running_loop().create_task(self._notify())
            self._notifying.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._notifying.discard)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
