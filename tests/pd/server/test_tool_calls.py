"""Tool calls on a live `pd serve` (tiny Qwen3, whose template shows the tools): forced by
tool_choice "required" or a named function, each call names a tool and its arguments
follow the tool's schema; streamed calls equal the unstreamed ones; a conversation
carrying earlier calls and their results is taken; "auto" and "none" answer content."""

from __future__ import annotations

import json

import pytest

from launch import http_client
from tests.support.pd_client import TIMEOUT_S, choices

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "A city's weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
BODY = {"messages": [{"role": "user", "content": "Weather in Paris, and the time?"}], "tools": [WEATHER, TIME],
        "max_tokens": 80, "temperature": 0.8, "seed": 6, "n": 3}


@pytest.fixture(scope="module")
def server(colocated):
    return colocated["qwen3"]  # the worker's plain qwen3 server: these tests leave it as they found it


def calls(choice: dict) -> list[tuple[str, dict]]:
    found = choice["message"].get("tool_calls") or []
    for call in found:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


def follows_schema(name: str, arguments: dict) -> bool:
    if name == "get_weather":
        return set(arguments) == {"city", "unit"} and len(arguments["city"]) <= 8 and arguments["unit"] in "CF"
    return name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.mark.parametrize("tool_choice, finish_reason", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_time"}}, "stop"),  # OpenAI's answer for a named function
])
def test_forced_calls_name_a_tool_and_follow_its_schema(server, tool_choice, finish_reason) -> None:
    body = BODY | {"tool_choice": tool_choice}
    whole = choices(server, body, "chat/completions")
    for choice in whole:
        made = calls(choice)
        assert made and all(follows_schema(*call) for call in made), choice
        assert choice["finish_reason"] == finish_reason and choice["message"]["content"] is None
        if isinstance(tool_choice, dict):
            assert [name for name, _ in made] == ["get_time"]  # one call, of that function
    streamed = choices(server, body, "chat/completions", streamed=True)
    for one, _other in zip(streamed, whole):
        deltas = one["message"]  # the merged deltas: content, and tool_calls gathered below
        assert deltas["content"] == "" and one["finish_reason"] == finish_reason
    assert [streamed_calls(server, body)] == [[calls(c) for c in whole]]
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def streamed_calls(server, body: dict) -> list[list[tuple[str, dict]]]:
    """Each choice's calls as streamed (one delta per call, indexed within the choice)."""
    found: dict[int, list] = {}
    with http_client().stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True},
                              timeout=TIMEOUT_S) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for call in choice["delta"].get("tool_calls", []):
                        assert call["index"] == len(found.setdefault(choice["index"], []))
                        found[choice["index"]].append((call["function"]["name"],
                                                       json.loads(call["function"]["arguments"])))
    return [found[i] for i in sorted(found)]


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_unforced_answers_are_content(server, tool_choice) -> None:
    """The random model writes no <tool_call>: its text is the content, as without tools."""
    for choice in choices(server, BODY | {"tool_choice": tool_choice}, "chat/completions"):
        assert choice["message"]["content"] and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] in ("stop", "length")


def test_a_conversation_with_earlier_calls_and_results_is_taken(server) -> None:
    messages = BODY["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    response = http_client().post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT_S,
                                  json=BODY | {"messages": messages, "n": 1, "return_token_ids": True})
    assert response.status_code == 200, response.text
    plain = http_client().post(f"{server.url}/v1/chat/completions", json=BODY | {"n": 1, "return_token_ids": True},
                               timeout=TIMEOUT_S).json()
    assert len(response.json()["choices"][0]["prompt_token_ids"]) > len(plain["choices"][0]["prompt_token_ids"])
    bad = http_client().post(f"{server.url}/v1/chat/completions",
                             json=BODY | {"messages": [{"role": "assistant", "content": None}]}, timeout=TIMEOUT_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.content"
