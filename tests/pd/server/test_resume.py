"""`resume` on a live `pd serve`: a stream taken up where another server left it (the
proxy's migration) goes on as if nothing had happened. Each case streams a request
whole, then again cut after k tokens, the rest asked for with `resume` (the tokens the
client got and the characters of text it was sent): the two halves joined equal the
whole stream token for token, text, logprobs, finish reason and usage; greedy and
seeded sampling, penalties, a JSON schema, a stop string straddling the cut."""

from __future__ import annotations

import json

import pytest

from launch import http_client
from tests.support.pd_client import TIMEOUT_S, _merge, assert_choices_close

PROMPT = "The lighthouse keeper counted the ships that passed the rocks each night"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}


@pytest.fixture(scope="module")
def server(colocated):
    return colocated["qwen3"]  # the worker's plain qwen3 server: these tests leave it as they found it


def stream_chunks(server, body: dict, endpoint: str) -> list[dict]:
    """Every chunk of the stream, parsed ([DONE] left out); none may be an error."""
    chunks = []
    with http_client().stream("POST", f"{server.url}/v1/{endpoint}", json=body | {"stream": True},
                              timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                assert "error" not in chunks[-1], chunks[-1]
    return chunks


def merged(chunks: list[dict], index: int = 0) -> dict:
    choice: dict = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            if part["index"] == index:
                _merge(choice, part)
    return choice


def text_of(choice: dict) -> str:
    return choice.get("text", choice.get("delta", {}).get("content") or "")


def cut(chunks: list[dict], tokens: int, n: int = 1) -> tuple[list[dict], list[dict]]:
    """The chunks a client had when the stream broke after the chunk that brought choice
    0 its `tokens`-th token: those chunks, and each choice as `resume` names it."""
    kept = []
    choices = [{"token_ids": [], "text_chars": 0, "finish_reason": None} for _ in range(n)]
    for chunk in chunks:
        if len(choices[0]["token_ids"]) >= tokens:
            break
        kept.append(chunk)
        for choice in chunk["choices"]:
            held = choices[choice["index"]]
            held["token_ids"] += choice.get("token_ids") or []
            held["text_chars"] += len(text_of(choice))
            held["finish_reason"] = choice["finish_reason"] or held["finish_reason"]
    return kept, choices


def resumed(server, body: dict, endpoint: str, tokens: int) -> tuple[list[dict], list[dict]]:
    """The whole stream, and the stream cut after `tokens` tokens joined with its resumption."""
    whole = stream_chunks(server, body, endpoint)
    first, choices = cut(whole, tokens, body.get("n", 1))
    assert len(choices[0]["token_ids"]) == tokens and len(first) < len(whole), "the cut must fall inside the stream"
    rest = stream_chunks(server, body | {"resume": {"choices": choices}}, endpoint)
    return whole, first + rest


CASES = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "seed": 7},
    "penalties": {"temperature": 0.8, "seed": 3, "frequency_penalty": 1.5, "presence_penalty": 0.5,
                  "repetition_penalty": 1.3},
    "top-k-p": {"temperature": 1.0, "seed": 5, "top_k": 40, "top_p": 0.9, "min_p": 0.01},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_resumed_stream_equals_the_uninterrupted_one(server, case, endpoint) -> None:
    body = {"max_tokens": 16, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}} | CASES[case]
    if endpoint == "completions":
        body |= {"prompt": PROMPT, "logprobs": 3, "echo": True}
    else:
        body |= {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 3}
    whole, joined = resumed(server, body, endpoint, tokens=6)
    assert_choices_close([merged(joined)], [merged(whole)], atol=1e-4)
    assert joined[-1]["usage"] | {"prompt_tokens_details": None} == whole[-1]["usage"] | {"prompt_tokens_details": None}
    assert joined[-1]["usage"]["completion_tokens"] == 16
    if endpoint == "chat/completions":  # the role opens the stream once
        assert sum("role" in c["choices"][0]["delta"] for c in joined if c["choices"]) == 1


def test_a_stop_string_straddling_the_cut_stops_the_resumed_stream_where_it_would_have(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 13, "ignore_eos": True,
            "return_token_ids": True}
    free = merged(stream_chunks(server, body, "completions"))["text"]
    for tokens in range(4, 20):  # a cut whose surrounding text occurs nowhere before it
        seam = len(http_client().post(f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                                      json=body | {"max_tokens": tokens}).json()["choices"][0]["text"])
        stop = free[seam - 3:seam + 3]  # the text around the end of token `tokens`
        if len(stop) == 6 and free.find(stop) == seam - 3:
            break
    else:
        pytest.fail(f"no cut of {free!r} has a stop string of its own")
    whole, joined = resumed(server, body | {"stop": [stop]}, "completions", tokens=tokens)
    assert merged(joined)["text"] == merged(whole)["text"] == free[:seam - 3]
    assert merged(joined)["finish_reason"] == merged(whole)["finish_reason"] == "stop"


def test_a_resumed_json_schema_stream_goes_on_from_where_its_grammar_stood(server) -> None:
    body = {"messages": [{"role": "user", "content": "Name a ship and how many there were, as JSON."}],
            "max_tokens": 40, "temperature": 0.7, "seed": 2, "return_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "ship", "schema": SCHEMA}}}
    whole, joined = resumed(server, body, "chat/completions", tokens=5)
    assert_choices_close([merged(joined)], [merged(whole)], atol=1e-4)
    text = merged(joined)["message"]["content"]
    if merged(joined)["finish_reason"] == "stop":
        assert set(json.loads(text)) >= {"name", "count"}


def test_a_resumed_stream_of_several_choices_goes_on_from_each_one_s_own_position(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "n": 3, "temperature": 0.9, "seed": 21, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 2, "stream_options": {"include_usage": True}}
    whole = stream_chunks(server, body, "completions")
    first, choices = cut(whole, 5, n=3)
    choices[2] = {"token_ids": merged(whole, 2)["token_ids"], "text_chars": len(merged(whole, 2)["text"]),
                  "finish_reason": "length"}  # one choice had ended: nothing more of it comes
    first = [c | {"choices": [x for x in c["choices"] if x["index"] != 2]} for c in first]
    rest = stream_chunks(server, body | {"resume": {"choices": choices}}, "completions")
    assert all(x["index"] != 2 for c in rest for x in c["choices"])
    joined = first + rest
    for index in (0, 1):
        assert_choices_close([merged(joined, index)], [merged(whole, index)], atol=1e-4)
    assert rest[-1]["usage"] == whole[-1]["usage"] | {"prompt_tokens_details": rest[-1]["usage"][
        "prompt_tokens_details"]} and rest[-1]["usage"]["completion_tokens"] == 48


def one(token_ids, **more) -> dict:
    return {"choices": [{"token_ids": token_ids} | more]}


@pytest.mark.parametrize("resume, extra, why", [
    (one([5, 6]), {"stream": False}, "stream: true"),
    (one([5, 6]), {"n": 2}, "1 entries for a request of 2 choices"),
    (one([5, 6], text_chars=10_000), {}, "characters released"),
    (one([10**9]), {}, "outside the vocabulary"),
    (one([5] * 8), {"max_tokens": 8}, "leaves none to generate"),
    (one([5], finish_reason="stop"), {}, "every choice of the resumed stream had ended"),
    ({"token_ids": [5]}, {}, "resume"),
])
def test_a_resume_that_cannot_be_taken_up_is_refused_with_a_400_naming_it(server, resume, extra, why) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "stream": True, "resume": resume} | extra
    response = http_client().post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert why in error["message"] and error["param"].startswith("resume"), error
