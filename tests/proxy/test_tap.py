"""The tap on a decode server's stream (proxy/tap.py) as a migration reads it: what the
client has been sent of each choice (token ids, characters of text, its end), an error
event held back with everything after it, and a later server's chunks given the first
one's id."""

from __future__ import annotations

import json

import pytest

from proxy.migration import failure, resumable
from proxy.tap import Tap


def events(*chunks: dict | str) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n" for c in chunks)


def chunk(text: str, ids: list[int], finish: str | None = None, id_: str = "cmpl-1", created: int = 1,
          chat: bool = False) -> dict:
    choice = {"index": 0, "token_ids": ids, "finish_reason": finish}
    choice |= {"delta": {"content": text}} if chat else {"text": text}
    return {"id": id_, "created": created, "choices": [choice]}


def sent(tap: Tap, raw: bytes, split: int = 7) -> list[dict | str]:
    out = b"".join(tap.chunk(raw[i:i + split]) for i in range(0, len(raw), split)) + tap.flush()
    return [json.loads(e[6:]) if e.startswith("data: {") else e for e in out.decode().split("\n\n") if e]


@pytest.mark.parametrize("chat", [False, True])
def test_what_the_client_was_sent_is_counted_whatever_the_chunking(chat) -> None:
    tap = Tap(keep=False, hold_errors=True)
    out = sent(tap, events(chunk("", [], chat=chat), chunk("h\u00e9", [5, 6], chat=chat),
                           chunk("llo", [7], chat=chat)))
    assert (tap.token_ids, tap.choice(0).text_chars, tap.events) == ([5, 6, 7], 5, 3)
    assert all("token_ids" not in c["choices"][0] for c in out)


def test_an_error_event_is_held_back_with_all_that_follows_it() -> None:
    tap = Tap(keep=True, hold_errors=True)
    error = {"message": "the engine died while serving this request", "type": "internal_error",
             "code": "engine_died"}
    out = sent(tap, events(chunk("a", [5]), {"error": error}, chunk("b", [6]), "[DONE]"))
    assert out == [chunk("a", [5])] and tap.error == error and tap.token_ids == [5]
    assert failure(error=tap.error) == "engine_died"
    assert failure(error={"code": "kv_load_failed"}) is None  # the request's own failure: passed on


def test_without_hold_errors_an_error_event_passes() -> None:
    tap = Tap(keep=True)
    assert sent(tap, events({"error": {"code": "engine_died"}}, "[DONE]")) == [{"error": {"code": "engine_died"}},
                                                                               "data: [DONE]"]


def test_after_a_switch_the_next_server_s_chunks_carry_the_first_one_s_id_and_the_rest_is_dropped() -> None:
    tap = Tap(keep=True, hold_errors=True)
    first = tap.chunk(events(chunk("a", [5])) + b"data: {\"id\": \"cmpl-1\", \"cho")  # broken mid-event
    tap.switched()
    second = sent(tap, events(chunk("b", [6], "length", id_="cmpl-2", created=9), "[DONE]"))
    assert first == events(chunk("a", [5]))
    assert second == [chunk("b", [6], "length"), "data: [DONE]"]
    assert tap.token_ids == [5, 6] and tap.finish_reason == "length"


def test_a_client_that_asked_for_token_ids_gets_the_stream_byte_for_byte() -> None:
    raw = events(chunk("a", [5]), chunk("b", [6], "stop"), "[DONE]")
    tap = Tap(keep=True, hold_errors=True)
    assert b"".join(tap.chunk(raw[i:i + 5]) for i in range(0, len(raw), 5)) + tap.flush() == raw


@pytest.mark.parametrize(("body", "ok"), [({}, True), ({"n": 2}, True), ({"tools": [{"type": "function"}]}, False),
                                          ({"tools": []}, True)])
def test_a_stream_read_for_tool_calls_is_not_resumed(body, ok) -> None:
    assert resumable(body) is ok


def test_each_choice_is_counted_apart() -> None:
    tap = Tap(keep=False, hold_errors=True)
    two = {"id": "c", "choices": [{"index": 1, "text": "xy", "token_ids": [9, 8], "finish_reason": "stop"},
                                  {"index": 0, "text": "a", "token_ids": [5], "finish_reason": None}]}
    sent(tap, events(two, chunk("b", [6])))
    assert (tap.choice(0).token_ids, tap.choice(0).text_chars, tap.choice(0).finish_reason) == ([5, 6], 2, None)
    assert (tap.choice(1).token_ids, tap.choice(1).text_chars, tap.choice(1).finish_reason) == ([9, 8], 2, "stop")
