"""Structured outputs on a live `pd serve` (a tiny random model: whatever it would say, the
grammar decides what it may): JSON schemas that parse and validate, regexes, choices and
Lark grammars, each request stopping where its grammar ends; n sequences each valid;
streamed equal to unstreamed; the KV back to 0."""

from __future__ import annotations

import json
import re

import pytest

from launch import http_client
from tests.support.pd_client import TIMEOUT_S, assert_choices_close, choices

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(colocated):
    return colocated["qwen3"]  # the worker's plain qwen3 server: these tests leave it as they found it


def valid(value: dict) -> bool:
    return (set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and 0 <= value["age"] <= 150
            and all(tag in "abc" for tag in value["tags"]) and len(value["tags"]) <= 3)


BASE = {"max_tokens": 60, "temperature": 1.0, "seed": 2, "n": 3}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"guided_json": json.dumps(SCHEMA)},
])
def test_a_json_schema_gives_json_that_validates(server, endpoint, constraint) -> None:
    body = BASE | constraint | ({"prompt": "Someone:"} if endpoint == "completions" else
                                {"messages": [{"role": "user", "content": "Someone?"}]})
    for choice in choices(server, body, endpoint):
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        assert valid(json.loads(text)), text
        assert choice["finish_reason"] == "stop"  # ended by the grammar, not by max_tokens


@pytest.mark.parametrize("constraint, check", [
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"structured_outputs": {"grammar": 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'}},
     lambda text: re.fullmatch(r"x=[1-9][0-9]?;", text)),
])
def test_regexes_choices_and_grammars_are_followed_to_their_end(server, constraint, check) -> None:
    body = BASE | {"prompt": "Answer:", "temperature": 0.7} | constraint
    whole = None  # the non-streamed answer (the first iteration's), which the streamed one must match
    for streamed in (False, True):
        got = choices(server, body, streamed=streamed)
        for choice in got:
            assert check(choice["text"]) and choice["finish_reason"] == "stop", choice
        if streamed:
            assert_choices_close(got, whole, atol=0)
        else:
            whole = got
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_grammar_that_cannot_be_enforced_is_refused_before_anything_runs(server) -> None:
    for bad in ({"guided_json": {"type": "array", "uniqueItems": True}}, {"guided_regex": "(("},
                {"response_format": {"type": "structural_tag"}}):
        for stream in (False, True):
            response = http_client().post(f"{server.url}/v1/completions",
                                          json={"prompt": "x", "stream": stream} | bad, timeout=TIMEOUT_S)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] in {*bad, "response_format.type"}


def test_json_object_starts_an_object_with_no_loose_whitespace(server) -> None:
    """A random model may not close it within max_tokens; what it wrote is an object
    (or an object's start), laid out compactly (json.dumps' separators)."""
    body = BASE | {"prompt": "Answer:", "max_tokens": 12, "n": 6, "response_format": {"type": "json_object"}}
    for choice in choices(server, body):
        text = choice["text"]
        assert text.startswith("{") and not re.search(r"\s{2}|\n|\t", text), choice
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


def chained_lark(rules: int) -> str:
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "a"'])


def chained_refs(refs: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(refs)} | {f"d{refs}": {"type": "string"}}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize("constraint, limit", [
    ({"structured_outputs": {"grammar": chained_lark(2750)}}, "rules"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": chained_refs(2500)}}}, "$refs"),
    ({"guided_regex": "a" * 300_000}, "characters"),
])
def test_a_grammar_past_a_limit_is_a_400_naming_it_and_the_server_lives(server, constraint, limit) -> None:
    """Issue 31 row 1: a Lark grammar of 2,750 chained rules, or a JSON schema with a
    chain of 2,500 $refs, segfaulted the API process inside llguidance."""
    pid = server.process.pid
    response = http_client().post(f"{server.url}/v1/completions", json={"prompt": "x"} | constraint,
                                  timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_grammar" and limit in error["message"] and "limit" in error["message"]
    assert server.process.poll() is None and server.process.pid == pid and server.health().status_code == 200
    good = {"prompt": "Answer:", "max_tokens": 8, "guided_choice": ["yes", "no"]}
    assert http_client().post(f"{server.url}/v1/completions", json=good, timeout=TIMEOUT_S).json()[
        "choices"][0]["text"] in ("yes", "no")
