"""The grammar checker (pd/structured/checker.py): grammars past a limit are refused with
the limit named, llguidance's verdict otherwise, from a process of its own that a
grammar may crash or hang without taking the caller with it."""

from __future__ import annotations

import json
import re

import pytest

from pd.structured import limits
from pd.structured.checker import GrammarChecker
from pd.structured.grammar import Grammar, GrammarError


def chain(rules: int) -> Grammar:
    return Grammar("lark", "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "a"']))


@pytest.fixture
def checker():
    checker = GrammarChecker()
    yield checker
    checker.close()


def test_good_and_bad_grammars_get_llguidances_verdict(checker) -> None:
    checker.check(Grammar("regex", "[a-z]{3}"))
    checker.check(chain(100))
    with pytest.raises(GrammarError, match="regex"):
        checker.check(Grammar("regex", "(("))
    with pytest.raises(GrammarError):
        checker.check(Grammar("json_schema", json.dumps({"type": "array", "uniqueItems": True})))


@pytest.mark.parametrize("grammar, named", [
    (chain(limits.MAX_LARK_RULES + 1), f"limit of {limits.MAX_LARK_RULES}"),
    (Grammar("json_schema", json.dumps({"$defs": {f"d{i}": {"$ref": "#/$defs/d0"} for i in range(1001)}})),
     f"1001 $refs, more than this server's limit of {limits.MAX_SCHEMA_REFS}"),
    (Grammar("regex", "a" * (limits.MAX_GRAMMAR_CHARS + 1)), "characters"),
])
def test_a_grammar_past_a_limit_is_refused_naming_it_before_llguidance_sees_it(checker, grammar, named) -> None:
    with pytest.raises(GrammarError, match=re.escape(named)):
        checker.check(grammar)
    assert checker._process is None  # never started: the limits are checked here


def test_nesting_is_measured_without_recursion() -> None:
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert limits._measure({"a": deep, "$ref": "x"}) == (5002, 1)


def test_a_grammar_that_crashes_the_checker_fails_alone_and_the_next_is_checked(checker, monkeypatch) -> None:
    monkeypatch.setattr(limits, "MAX_LARK_RULES", 100_000)
    monkeypatch.setattr(limits, "MAX_GRAMMAR_CHARS", 10 << 20)
    checker.check(chain(10))
    first = checker._process.pid
    with pytest.raises(GrammarError, match="crashed the grammar library"):
        checker.check(chain(20_000))  # overflows the checker's 16 MiB stack
    assert checker.crashes == 1
    checker.check(chain(10))  # a verdict kept
    checker.check(chain(11))  # a new checker process
    assert checker._process.pid != first


def test_a_grammar_that_takes_too_long_fails_alone(checker, monkeypatch) -> None:
    monkeypatch.setattr(limits, "MAX_GRAMMAR_CHARS", 10 << 20)
    checker.check(chain(3))  # started
    checker.timeout_s = 0.05
    properties = {f"p{i}": {"type": "string"} for i in range(40_000)}  # ~1 s to validate here
    slow = Grammar("json_schema", json.dumps({"type": "object", "properties": properties,
                                              "required": list(properties)}))
    with pytest.raises(GrammarError, match="longer than 0.05 s"):
        checker.check(slow)
    assert checker.crashes == 1 and checker._process is None
    checker.timeout_s = 10.0
    checker.check(chain(4))
    with pytest.raises(GrammarError, match="schema too large"):  # a timeout is not kept: llguidance's verdict
        checker.check(slow)


def test_the_timeout_starts_when_a_new_checker_is_ready(checker) -> None:
    checker.timeout_s = 0.05  # far less than a start takes (importing llguidance)
    checker.check(chain(3))
    assert checker.crashes == 0
