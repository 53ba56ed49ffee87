"""The PD canary's parts alone (proxy/canary.py): which requests it takes, how it reads a
PD answer's token ids as they pass (and takes them out of what the client gets unless it
asked), what it asks the colocated server, and how two answers compare: a tie is a first
difference at a token the reference found about as likely as its own."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.canary import Canaries, compare, pins_tokens, reference_body
from proxy.tap import Tap


@pytest.mark.parametrize(("body", "pinned"), [
    ({"temperature": 0}, True), ({"temperature": 0.0, "n": 1}, True), ({"temperature": 0.7, "seed": 3}, True),
    ({"temperature": 0.7}, False), ({}, False), ({"temperature": 0, "n": 2}, False),
    ({"temperature": 0, "best_of": 3}, False), ({"temperature": 1, "seed": True}, False)])
def test_only_greedy_or_seeded_single_sequences_are_taken(body, pinned) -> None:
    assert pins_tokens(body) is pinned


def stream_of(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


CHUNKS = [{"choices": [{"index": 0, "text": "a", "token_ids": [5, 6], "finish_reason": None}]},
          {"choices": [{"index": 0, "text": "b", "token_ids": [7], "finish_reason": "length"}]}]


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_a_stream_s_token_ids_are_read_and_taken_out_whatever_its_chunking(split) -> None:
    raw = stream_of(*CHUNKS)
    tap = Tap(keep=False)
    out = b"".join(tap.chunk(raw[i:i + split]) for i in range(0, len(raw), split)) + tap.flush()
    assert tap.token_ids == [5, 6, 7] and tap.finish_reason == "length" and tap.broken is None
    events = [e for e in out.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b"]
    assert all("token_ids" not in c["choices"][0] for c in chunks)


def test_a_client_that_asked_for_token_ids_gets_the_stream_byte_for_byte() -> None:
    raw = stream_of(*CHUNKS)
    tap = Tap(keep=True)
    assert b"".join(tap.chunk(raw[i:i + 5]) for i in range(0, len(raw), 5)) + tap.flush() == raw
    assert tap.token_ids == [5, 6, 7]


def test_an_answer_s_token_ids_are_read_and_taken_out() -> None:
    answer = {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "top_token_ids": [],
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3}}
    tap = Tap(keep=False)
    out = json.loads(tap.body(json.dumps(answer).encode()))
    assert tap.token_ids == [5, 6] and tap.finish_reason == "stop"
    assert out["choices"][0] == {"index": 0, "text": "ab", "finish_reason": "stop"} and out["usage"] == answer["usage"]
    broken = Tap(keep=False)
    assert broken.body(b"not json") == b"not json" and broken.broken is not None


def test_the_reference_runs_alone_unstreamed_with_ids_and_two_likeliest() -> None:
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True}, "logprobs": 5}
    assert reference_body(body) == {"prompt": "x", "temperature": 0, "logprobs": 5, "return_token_ids": True}
    chat = reference_body({"messages": [], "seed": 1})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2 and chat["return_token_ids"] is True


ROWS = [[[5, -0.1], [5, -0.1], [9, -2.5]],  # position 0: 5 chosen, 9 far behind
        [[6, -0.70], [6, -0.70], [8, -0.72]],  # position 1: 6 and 8 about as likely
        [[7, -0.5], [7, -0.5], [4, -0.9]]]


@pytest.mark.parametrize(("pd", "expected"), [
    ([5, 6, 7], ("match", None)),
    ([5, 8, 3], ("tie", 1)),  # 8 was within 0.05 of 6
    ([9, 6, 7], ("mismatch", 0)),  # 9 was far less likely
    ([5, 6, 2], ("mismatch", 2)),  # 2 was not among the two likeliest
    ([5, 6], ("mismatch", 2)),  # shorter
])
def test_answers_compare_at_their_first_difference(pd, expected) -> None:
    assert compare(pd, [5, 6, 7], ROWS, 0.05) == expected
    if expected[0] == "tie":
        assert compare(pd, [5, 6, 7], ROWS, 0.01) == ("mismatch", 1)


def test_at_most_max_inflight_canaries_run_and_a_failed_answer_runs_none() -> None:
    counted: list[str] = []
    released = asyncio.Event()

    async def run():
        await released.wait()
        return "match"

    async def scenario():
        canaries = Canaries(1.0, 2, 0.05, counted.append, draw=lambda: 0.0)
        assert all(canaries.samples(type("C", (), {"body": {"temperature": 0}})()) for _ in range(4))
        taps = [Tap(keep=False) for _ in range(4)]
        for tap in taps:
            tap.choice(0).finish_reason = "stop"
        canaries.done(taps[0], False, run)  # the answer failed: no canary
        for tap in taps[1:]:
            canaries.done(tap, True, run)
        assert canaries.inflight == 2 and counted == ["skipped"]
        released.set()
        await asyncio.sleep(0.01)
        assert canaries.inflight == 0 and sorted(counted) == ["match", "match", "skipped"]

    asyncio.run(scenario())
