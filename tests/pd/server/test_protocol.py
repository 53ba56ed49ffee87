"""Request parsing: strict types, errors that name the field, refused unsupported fields."""

from __future__ import annotations

import json

import pytest

from pd.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse_body, refuse_unsupported


def parse(body, model=CompletionRequest):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_body(raw, model)


@pytest.mark.parametrize("raw, param, code", [
    (b"{not json", None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_body"),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"prompt": ["a", 1]}, "prompt", "invalid_type"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "max_tokens": 5.0}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"prompt": "x", "stop": [1]}, "stop", "invalid_type"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
    ({"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params", "invalid_type"),
])
def test_bad_completion_bodies_name_the_field(raw, param, code) -> None:
    with pytest.raises(RequestError) as e:
        parse(raw)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages, param", [
    ("hi", "messages"),
    ([{"role": "wizard", "content": "x"}], "messages.0.role"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
])
def test_bad_chat_messages_name_the_field(messages, param) -> None:
    """(A missing content, allowed to an assistant message with tool calls, is refused by
    the server: malformed.py's "content missing".)"""
    with pytest.raises(RequestError) as e:
        parse({"messages": messages}, ChatCompletionRequest)
    assert e.value.param == param


def test_text_parts_are_joined_and_max_completion_tokens_wins() -> None:
    body = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}],
                  "max_tokens": 5, "max_completion_tokens": 7}, ChatCompletionRequest)
    assert body.messages[0].text() == "a\nb"
    assert body.output_limit == 7


def test_prompt_shapes() -> None:
    assert parse({"prompt": [1, 2]}).prompt == [1, 2]
    assert parse({"prompt": [[1, 2]]}).prompt == [[1, 2]]
    assert parse({"prompt": "x", "stop": "a"}).stop_strings == ["a"]


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("field, value", [("length_penalty", 1.2), ("typical_p", 0.9), ("guided_decoding_backend", "x"),
                                          ("whitespace_pattern", " "), ("functions", []), ("some_future_field", 1)])
def test_fields_the_server_does_not_know_are_refused_not_ignored(model, field, value) -> None:
    """Another server's sampling or structured-output field, silently dropped, would give
    an answer the client believes was shaped by it."""
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": []}
    body = parse(base | {field: value}, model)
    with pytest.raises(RequestError) as e:
        refuse_unsupported(body)
    assert (e.value.param, e.value.code, e.value.status) == (field, "unsupported", 400)
    assert f"{field} is not supported" in str(e.value)


def test_bookkeeping_fields_pass_unread() -> None:
    refuse_unsupported(parse({"prompt": "x", "user": "u", "metadata": {"a": "b"}, "store": False,
                              "service_tier": "auto"}))


@pytest.mark.parametrize("field, value", [("suffix", "x")])
def test_unsupported_completion_fields_are_refused(field, value) -> None:
    body = parse({"prompt": "x", field: value})
    with pytest.raises(RequestError) as e:
        refuse_unsupported(body)
    assert e.value.param == field and e.value.code == "unsupported"


def test_harmless_defaults_of_unsupported_fields_pass() -> None:
    refuse_unsupported(parse({"prompt": "x", "n": 1, "echo": False, "min_tokens": 0, "best_of": 1}))
    refuse_unsupported(parse({"messages": [], "logprobs": False, "response_format": {"type": "text"}},
                             ChatCompletionRequest))
