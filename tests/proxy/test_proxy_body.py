"""`proxy/body.py`'s strict parser: what it refuses (each with its code, never a crash)
and that whatever it accepts encodes again as strict JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.body import MAX_DEPTH, BodyError, parse_body


def nested(depth: int) -> bytes:
    """A body whose innermost array is at `depth` (the body itself is depth 1)."""
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def strict(value: object) -> bytes:
    """What the proxy does to a body it sends on: httpx's encoding."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


@pytest.mark.parametrize(("raw", "code", "param"), [
    (b'{"temperature": NaN}', "non_finite_number", None),
    (b'{"temperature": Infinity}', "non_finite_number", None),
    (b'{"logit_bias": {"1": -Infinity}}', "non_finite_number", None),
    (b'{"temperature": 1e309}', "non_finite_number", None),
    (b'{"top_p": [0.5, -1.5e400]}', "non_finite_number", None),
    (b'{"prompt": "\\ud800"}', "lone_surrogate", "prompt"),
    (b'{"messages": [{"role": "user", "content": "hi \\udfff there"}]}', "lone_surrogate", "messages.0.content"),
    (b'{"prompt": ["ok", "\\ud83d"]}', "lone_surrogate", "prompt.1"),
    (b'{"\\ud800": 1}', "lone_surrogate", "\\ud800"),
    (b'{"extra": {"\\udc00key": true}}', "lone_surrogate", "extra.\\udc00key"),
    (b"[1, 2]", "invalid_body", None),
    (b'"a string"', "invalid_body", None),
    (b"null", "invalid_body", None),
    (b"42", "invalid_body", None),
    (b"", "invalid_json", None),
    (b'{"prompt": "x",}', "invalid_json", None),
    (b'{"a": 1} {"b": 2}', "invalid_json", None),
    (b"\xef\xbb\xbf{}", "invalid_json", None),
    (b'{"prompt": "\xff"}', "invalid_utf8", None),
    (b'{"prompt": "\xed\xa0\x80"}', "invalid_utf8", None),  # a surrogate encoded as UTF-8
    ('{"prompt": "x"}'.encode("utf-16"), "invalid_utf8", None),
    (b'{"seed": ' + b"9" * 5000 + b"}", "number_too_large", None),
])
def test_a_body_that_is_not_strict_json_is_refused_with_its_code(raw, code, param) -> None:
    with pytest.raises(BodyError) as caught:
        parse_body(raw)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, code, param)
    response = caught.value.response()  # the error itself always encodes
    assert response.status_code == 400 and json.loads(response.body)["error"]["code"] == code


def test_nesting_is_allowed_up_to_the_limit_and_refused_past_it() -> None:
    assert parse_body(nested(MAX_DEPTH))["a"] is not None
    with pytest.raises(BodyError) as caught:
        parse_body(nested(MAX_DEPTH + 1))
    assert caught.value.code == "nesting_too_deep" and caught.value.param.startswith("a.0.0")
    with pytest.raises(BodyError, match="deeper than 3"):
        parse_body(b'{"a": {"b": {"c": {}}}}', max_depth=3)
    assert parse_body(b'{"a": {"b": {}}}', max_depth=3) == {"a": {"b": {}}}


def test_nesting_deeper_than_the_interpreters_stack_is_a_body_error() -> None:
    with pytest.raises(BodyError) as caught:
        parse_body(nested(200_000))
    assert caught.value.code == "nesting_too_deep"


def test_what_strict_json_allows_passes_unchanged() -> None:
    raw = ('{"prompt": "caf\\u00e9 \\ud83d\\ude00 ü", "seed": 123456789012345678901234567890, "n": -2, '
           '"t": 1e-400, "x": [null, true, 1.5e300, {"k": []}], "é": "\\"quoted\\""}').encode()
    body = parse_body(raw)
    assert body == {"prompt": "café 😀 ü", "seed": 123456789012345678901234567890, "n": -2, "t": 0.0,
                    "x": [None, True, 1.5e300, {"k": []}], "é": '"quoted"'}
    assert json.loads(strict(body)) == body


def test_a_large_token_id_prompt_is_accepted() -> None:
    body = {"prompt": list(range(200_000)), "max_tokens": 5}
    assert parse_body(strict(body)) == body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6))
def test_every_strict_json_object_round_trips(body) -> None:
    assert parse_body(strict(body)) == body


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(lambda t: ('{"p": ' + t + "}").encode()))
def test_anything_accepted_encodes_again_and_anything_else_is_a_body_error(raw) -> None:
    try:
        body = parse_body(raw)
    except BodyError as exc:
        assert exc.status == 400 and exc.code
        return
    assert isinstance(body, dict) and json.loads(strict(body)) == body


def encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(categories=("Cs", "Ll", "Nd", "So")), max_size=12))
def test_escaped_surrogates_are_refused_exactly_when_one_is_left_alone(text) -> None:
    raw = json.dumps({"p": text, "k" + text: 1}).encode()  # escapes each surrogate; a pair decodes to one char
    decoded = json.loads(raw)["p"]
    if encodes(decoded):
        assert parse_body(raw)["p"] == decoded
    else:
        with pytest.raises(BodyError, match="lone UTF-16 surrogate"):
            parse_body(raw)
