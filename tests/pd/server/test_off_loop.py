"""Work before the engine (pd/server/off_loop.py): a thread waiting on the grammar checker
gives its slot up, so requests that do not wait are prepared meanwhile; past `waiters`
waiting, a request is refused at once."""

from __future__ import annotations

import threading

import anyio
import pytest

from pd.server.off_loop import OffLoop, TooManyWaiting


def test_threads_waiting_give_their_slot_up_and_past_the_bound_are_refused() -> None:
    off_loop = OffLoop(cpu=2, waiters=3)
    release = threading.Event()
    waiting = []

    def slow_grammar() -> str:
        return off_loop.waiting(lambda: (waiting.append(1), release.wait(30))[1] and "checked")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            results = []

            async def run(work) -> None:
                results.append(await off_loop.run(work))

            for _ in range(3):
                tg.start_soon(run, slow_grammar)
            with anyio.fail_after(10):
                while len(waiting) < 3:  # all three wait on "the checker", none in a slot
                    await anyio.sleep(0.01)
                assert [await off_loop.run(lambda: "plain") for _ in range(4)] == ["plain"] * 4
                with pytest.raises(TooManyWaiting):
                    await off_loop.run(slow_grammar)
            release.set()
        assert results == ["checked"] * 3

    anyio.run(main)
