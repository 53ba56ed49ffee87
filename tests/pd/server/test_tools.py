"""Tool calls: the Hermes blocks read from an answer, whole and as it streams in (the
pieces add up to the whole reading however the text is cut), the grammar tool_choice
imposes (it takes well-formed calls of the tools and nothing else), and the request
checks (tools a template cannot show, a tool_choice without tools or naming none)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.models.tiny_tokenizer import FAMILIES, build_tokenizer
from pd.server.protocol import ChatCompletionRequest, RequestError, parse_body
from pd.server.tools import ToolCallStream, parse_tool_calls, request_tools, tool_grammar
from pd.structured.grammar import Grammar
from pd.structured.matchers import GrammarMatchers

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def functions(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_content_then_calls() -> None:
    content, calls = parse_tool_calls("Let me look." + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content == "Let me look."
    assert functions(calls) == [("get_weather", {"city": "Paris", "unit": "C"}),
                                ("get_weather", {"city": "Oslo", "unit": "C"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text, calls", [
    ("No tools needed.", 0),
    (CALL[:-len("</tool_call>")], 1),  # an unclosed last block still counts (EOS came first)
    ("<tool_call>\n{not json}\n</tool_call>", 0),  # not a call: the text is the content
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', 0),  # no name
    (CALL + "\n<tool_call>\n{broken\n</tool_call>", 1),  # calls up to the first bad block
])
def test_what_is_and_is_not_a_call(text, calls) -> None:
    content, found = parse_tool_calls(text)
    assert len(found) == calls
    assert content == (text if calls == 0 else None)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["", "Sure: ", "<tool", "a <tool_c b", "x</tool_call>"]),
       st.lists(st.sampled_from([CALL, "\n", "<tool_call>\n{bad}\n</tool_call>", "tail"]), max_size=4),
       st.lists(st.integers(1, 9), min_size=1, max_size=60))
def test_a_stream_adds_up_to_the_whole_reading(prefix, parts, cuts) -> None:
    text = prefix + "".join(parts)
    stream, content, calls, position = ToolCallStream(), "", [], 0
    for size in cuts * (len(text) + 1):
        if position >= len(text):
            break
        piece, new = stream.feed(text[position:position + size])
        content, calls, position = content + piece, calls + new, position + size
    piece, new = stream.finish()
    content, calls = content + piece, calls + new
    whole_content, whole_calls = parse_tool_calls(text)
    assert content == (whole_content or "") and functions(calls) == functions(whole_calls)


@pytest.fixture(scope="module", params=[("qwen3", True), ("gemma3", False)], ids=["tags-are-tokens", "tags-as-text"])
def matchers(request):
    """A family whose tokenizer has <tool_call> and </tool_call> as tokens, and one without."""
    family, tags_are_tokens = request.param
    tokenizer = build_tokenizer(FAMILIES[family], 4096)
    assert (tokenizer.token_to_id("<tool_call>") is not None) == tags_are_tokens
    matchers = GrammarMatchers(tokenizer.to_str, [tokenizer.token_to_id(FAMILIES[family].eos)])
    yield matchers, tokenizer, tags_are_tokens
    matchers.shutdown()


def takes(matchers, tokenizer, grammar, text: str, request_id: str) -> bool:
    matchers.compile(request_id, grammar)
    deadline = time.monotonic() + 30
    while request_id not in matchers and time.monotonic() < deadline:
        assert all(error is None for _, error in matchers.ready())
        time.sleep(0.01)
    return all(matchers.accept(request_id, t) for t in tokenizer.encode(text, add_special_tokens=False).ids)


def test_the_tool_grammar_takes_calls_of_the_tools_and_nothing_else(matchers) -> None:
    m, tokenizer, tags_are_tokens = matchers
    required = tool_grammar([WEATHER, TIME], None, True, tags_are_tokens)
    assert takes(m, tokenizer, required, CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                 "</tool_call>", f"ok-{tags_are_tokens}")
    for i, bad in enumerate(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                             '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',
                             "I would rather not."]):
        assert not takes(m, tokenizer, required, bad, f"bad{i}-{tags_are_tokens}")
    named = tool_grammar([WEATHER, TIME], "get_time", False, tags_are_tokens)
    assert not takes(m, tokenizer, named, CALL, f"named-{tags_are_tokens}")


def body(**fields) -> ChatCompletionRequest:
    return parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}]} | fields).encode(),
                      ChatCompletionRequest)


def test_tool_choice_decides_the_reading_and_the_grammar() -> None:
    tools, use, grammar = request_tools(body(tools=[WEATHER]), True, True, Grammar.check)
    assert tools == [WEATHER] and use.parse and not use.named and grammar is None  # auto
    assert request_tools(body(tools=[WEATHER], tool_choice="none"), True, True, Grammar.check)[1].parse is False
    assert request_tools(body(tools=[WEATHER], tool_choice="required"), True, True, Grammar.check)[2] is not None
    _, use, grammar = request_tools(body(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), True, True, Grammar.check)
    assert use.named and "get_weather" not in grammar.value
    assert request_tools(body(), False, True, Grammar.check) == (None, use.__class__(), None)


@pytest.mark.parametrize("fields, renders, param", [
    ({"tools": [WEATHER]}, False, "tools"),  # the template would not show them
    ({"tool_choice": "required"}, True, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, True, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
      "tool_choice": "required"}, True, "tools"),
])
def test_tools_that_cannot_be_honoured_are_refused(fields, renders, param) -> None:
    with pytest.raises(RequestError) as e:
        request_tools(body(**fields), renders, True, Grammar.check)
    assert e.value.param == param and e.value.status == 400
