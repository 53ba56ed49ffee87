"""GrammarMatchers on a tiny tokenizer: masks that allow exactly the tokens the grammar
can continue with, a matcher that stops where its grammar ends, forks that go their own
way, one compilation per distinct grammar, and grammars that cannot be compiled failing
their request alone."""

from __future__ import annotations

import json
import re
import time

import pytest

from pd.models.tiny_tokenizer import FAMILIES, build_tokenizer
from pd.structured.grammar import Grammar, GrammarError
from pd.structured.matchers import GrammarMatchers

VOCAB = 4096


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(FAMILIES["qwen3"], VOCAB)


@pytest.fixture
def matchers(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    matchers = GrammarMatchers(tokenizer.to_str, [eos])
    yield matchers
    matchers.shutdown()


def compiled(matchers: GrammarMatchers, *requests: tuple[str, Grammar]) -> dict[str, str | None]:
    for request_id, grammar in requests:
        matchers.compile(request_id, grammar)
    results: dict[str, str | None] = {}
    deadline = time.monotonic() + 60
    while len(results) < len(requests) and time.monotonic() < deadline:
        results |= dict(matchers.ready())
        time.sleep(0.01)
    return results


def allowed(matchers: GrammarMatchers, request_id: str) -> set[int]:
    words = matchers.masks([request_id])[request_id]
    return {32 * w + b for w, word in enumerate(words.tolist()) for b in range(32) if (word >> b) & 1}


def decode_each(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_the_mask_allows_exactly_the_tokens_that_keep_a_regex_matchable(matchers, tokenizer) -> None:
    grammar = Grammar("regex", r"[0-9]{3}-[a-z]+")
    assert compiled(matchers, ("r", grammar)) == {"r": None}
    first = allowed(matchers, "r")
    texts = decode_each(tokenizer, range(VOCAB))
    expected = {t for t, text in enumerate(texts)
                if text and re.fullmatch(r"[0-9]{1,3}|[0-9]{3}-[a-z]*", text)}
    assert first == expected and first
    for token in tokenizer.encode("123-ab", add_special_tokens=False).ids:
        assert token in allowed(matchers, "r") and matchers.accept("r", token)
    assert not matchers.is_stopped("r")  # more letters may follow
    digit = tokenizer.encode("7", add_special_tokens=False).ids[0]
    assert digit not in allowed(matchers, "r") and not matchers.accept("r", digit)
    # A failed matcher allows everything: its request fails at its next token, alone,
    # rather than leaving its row with nothing to sample from.
    assert allowed(matchers, "r") == set(range(32 * ((tokenizer.get_vocab_size() + 31) // 32)))
    assert not matchers.accept("r", first.pop())


def test_a_json_schema_stops_at_its_end_and_forks_go_their_own_way(matchers, tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    assert compiled(matchers, ("p", Grammar("json_schema", json.dumps(schema)))) == {"p": None}
    for token in tokenizer.encode('{"a": "', add_special_tokens=False).ids:
        assert matchers.accept("p", token)
    matchers.fork("p", "p/1")
    for request_id, value in (("p", 'x"}'), ("p/1", 'y"}')):
        for token in tokenizer.encode(value, add_special_tokens=False).ids:
            assert matchers.accept(request_id, token), (request_id, value)
        assert matchers.is_stopped(request_id)
    matchers.remove("p")
    assert "p" not in matchers and "p/1" in matchers
    assert matchers.accept("no grammar", 5) and not matchers.is_stopped("no grammar")


def test_json_is_laid_out_compactly(matchers, tokenizer) -> None:
    """No free whitespace: after `{` only `"` may follow (a small model could otherwise
    spend its budget on spaces)."""
    assert compiled(matchers, ("o", Grammar("json_object"))) == {"o": None}
    assert matchers.accept("o", tokenizer.encode("{", add_special_tokens=False).ids[0])
    texts = decode_each(tokenizer, allowed(matchers, "o"))
    assert texts and all(text.startswith('"') or text == "}" for text in texts)


def test_a_grammar_is_compiled_once_and_a_bad_one_fails_its_request_alone(matchers, monkeypatch) -> None:
    calls = []
    compile_one = matchers._compile
    monkeypatch.setattr(matchers, "_compile", lambda g: calls.append(g) or compile_one(g))
    choice = Grammar("choice", json.dumps(["yes", "no"]))
    results = compiled(matchers, ("a", choice), ("b", choice), ("bad", Grammar("lark", "start: missing")))
    assert results["a"] is None and results["b"] is None and "missing" in results["bad"]
    assert calls.count(choice) == 1
    assert "bad" not in matchers and allowed(matchers, "a") == allowed(matchers, "b")


def test_an_engine_without_a_tokenizer_says_so_per_request() -> None:
    matchers = GrammarMatchers(None, [0])
    assert "no tokenizer" in compiled(matchers, ("r", Grammar("regex", "a")))["r"]
    matchers.shutdown()


@pytest.mark.parametrize("grammar", [Grammar("regex", "(a"), Grammar("json_schema", '{"type": "nope"}'),
                                     Grammar("json_schema", '{"type": "array", "uniqueItems": true}'),
                                     Grammar("lark", "start: missing"), Grammar("choice", "[1, 2]")])
def test_check_refuses_what_cannot_be_enforced(grammar) -> None:
    with pytest.raises(GrammarError):
        grammar.check()
