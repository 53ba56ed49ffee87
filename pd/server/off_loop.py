"""Work done for a request before it reaches the engine (parsing, templates, tokenizing,
grammar checks), in worker threads, never on the event loop.

At most `cpu` threads work at once (the threads of big requests cannot crowd the event
loop out of the GIL). A thread that waits on something else, the grammar checker
(checker.py: one grammar at a time, 10 s at most), gives its slot up while it waits, so
a few slow grammars cannot hold every slot and stall requests that have none; at most
`waiters` wait at once, and past that a request is refused (503, Retry-After) rather
than queued behind a checker that is not keeping up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


class TooManyWaiting(Exception):
    """`waiters` threads wait already."""


class OffLoop:
    def __init__(self, cpu: int, waiters: int) -> None:
        self._threads = anyio.CapacityLimiter(cpu + waiters)
        self._cpu = threading.Semaphore(cpu)
        self._waiters = threading.BoundedSemaphore(waiters)

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` in a worker thread, holding a slot (unless it waits: `waiting`)."""
        return await anyio.to_thread.run_sync(self._in_slot, work, limiter=self._threads)

    def _in_slot(self, work: Callable[[], T]) -> T:
        with self._cpu:
            return work()

    def waiting(self, wait: Callable[[], T]) -> T:
        """`wait()`, called from `run`'s work, with the slot given up meanwhile;
        TooManyWaiting if `waiters` threads wait already."""
        if not self._waiters.acquire(blocking=False):
            raise TooManyWaiting
        self._cpu.release()
        try:
            return wait()
        finally:
            self._cpu.acquire()
            self._waiters.release()
