"""The proxy's queue (proxy/admission.py) on its own: order by priority then arrival, a
blocked queue lets only its head try again (on a change, or after Retry-After), a try
that places a request opens it, bounds give QueueFull and QueueTimeout."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission import Admission, QueueFull, QueueTimeout


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_an_open_queue_lets_a_request_through_at_once() -> None:
    async def main():
        admission = Admission(4, 60)
        await admission.turn(admission.ticket())
        assert admission.num_waiting == 0

    run(main())


def test_a_blocked_queue_goes_by_priority_then_arrival_one_try_per_change() -> None:
    async def main():
        admission = Admission(8, 60)
        admission.no_room(admission.ticket(), retry_after_s=60)  # a try just found no room
        order = []

        async def request(name, priority):
            await admission.turn(admission.ticket(priority))
            order.append(name)

        tasks = [asyncio.create_task(request(name, rank)) for name, rank in (("a", 0), ("b", 0), ("urgent", -1))]
        await asyncio.sleep(0.05)
        assert order == [] and admission.num_waiting == 3
        admission.changed()  # room may have freed: the head alone tries
        await asyncio.sleep(0.05)
        assert order == ["urgent"]
        admission.no_room(admission.ticket(), retry_after_s=60)  # it found none
        await asyncio.sleep(0.05)
        assert order == ["urgent"]
        admission.placed()  # a try placed its request: the queue opens
        await asyncio.gather(*tasks)
        assert order == ["urgent", "a", "b"]

    run(main())


def test_a_blocked_head_tries_again_after_retry_after_without_a_change() -> None:
    async def main():
        admission = Admission(8, 60)
        admission.no_room(admission.ticket(), retry_after_s=0.1)
        await admission.turn(admission.ticket())  # returns after ~0.1 s, not never

    run(main())


def test_bounds_full_and_timeout() -> None:
    async def main():
        admission = Admission(1, 0.2)
        admission.no_room(admission.ticket(), retry_after_s=60)
        waiting = asyncio.create_task(admission.turn(admission.ticket()))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull):
            await admission.turn(admission.ticket())
        with pytest.raises(QueueTimeout):
            await waiting
        assert admission.num_waiting == 0

    run(main())


def test_a_change_during_the_try_that_found_no_room_lets_it_try_again_at_once() -> None:
    """Room freed while a try was finding none (a request ended meanwhile) is not waited
    out for Retry-After."""
    async def main():
        admission = Admission(8, 60)
        ticket = admission.ticket()
        await admission.turn(ticket)  # its try begins
        admission.changed()  # a request ends meanwhile
        admission.no_room(ticket, retry_after_s=60)  # the try found no room
        await admission.turn(ticket)  # at once, not in 60 s

    run(main())
