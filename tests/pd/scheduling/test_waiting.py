"""The waiting queue: arrivals at the back, the scheduler's returns at the front, a request
with a grammar apart until it compiles, and a request leaving from wherever it waits."""

from __future__ import annotations

from pd.contracts.request import Request, RequestStatus
from pd.contracts.sampling_params import SamplingParams
from pd.scheduling.waiting import WaitingQueue
from pd.structured.grammar import Grammar


class Compiler:
    """What the queue uses of GrammarMatchers: compile, the compiled ones, and accept."""

    def __init__(self) -> None:
        self.compiling: list[str] = []
        self.done: list[tuple[str, str | None]] = []
        self.accepted: list[tuple[str, int]] = []

    def compile(self, req_id: str, grammar: Grammar) -> None:
        self.compiling.append(req_id)

    def ready(self) -> list[tuple[str, str | None]]:
        done, self.done = self.done, []
        return done

    def accept(self, req_id: str, token_id: int) -> bool:
        """A grammar allowing tokens below 100."""
        self.accepted.append((req_id, token_id))
        return token_id < 100


def request(req_id: str, grammar: Grammar | None = None) -> Request:
    return Request(req_id, [1, 2, 3], SamplingParams(max_tokens=4, grammar=grammar))


def test_arrivals_queue_at_the_back_and_returns_at_the_front() -> None:
    queue = WaitingQueue(Compiler())
    a, b, c, d = (request(x) for x in "abcd")
    for r in (a, b, c):
        queue.add(r)
    queue.put_front(d)  # preempted
    queue.to_front(c)  # the pool could not take it: it keeps its turn
    assert [r.request_id for r in queue] == ["c", "d", "a", "b"]
    queue.discard(a)  # admitted
    queue.discard(a)  # gone already: nothing
    assert [r.request_id for r in queue] == ["c", "d", "b"] and len(queue) == 3


def test_a_grammar_request_waits_apart_until_it_compiles() -> None:
    compiler = Compiler()
    queue = WaitingQueue(compiler)
    grammar = Grammar("regex", "[ab]+")
    good, bad, aborted = request("good", grammar), request("bad", grammar), request("aborted", grammar)
    for r in (good, bad, aborted):
        queue.add(r)
    assert len(queue) == 0 and good.status is RequestStatus.WAITING_FOR_GRAMMAR
    assert compiler.compiling == ["good", "bad", "aborted"]
    queue.discard(aborted)
    compiler.done = [("good", None), ("bad", "no such rule"), ("aborted", None)]
    assert queue.compiled() == [(bad, "the request's grammar cannot be compiled: no such rule")]
    assert [r.request_id for r in queue] == ["good"] and good.status is RequestStatus.WAITING
    assert queue.for_grammar == {}


def test_a_resumed_request_s_matcher_is_advanced_over_its_tokens_and_one_its_grammar_refuses_fails() -> None:
    compiler = Compiler()
    queue = WaitingQueue(compiler)
    grammar = Grammar("regex", "[ab]+")
    fits, off = request("fits", grammar), request("off", grammar)
    fits.output_token_ids, off.output_token_ids = [5, 6], [7, 300, 8]
    for r in (fits, off):
        queue.add(r)
    compiler.done = [("fits", None), ("off", None)]
    assert queue.compiled() == [(off, "resumed token 1 (300) is not allowed by the request's grammar there")]
    assert compiler.accepted == [("fits", 5), ("fits", 6), ("off", 7), ("off", 300)]
    assert [r.request_id for r in queue] == ["fits"]
