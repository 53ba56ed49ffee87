"""The requests waiting to be admitted, in the order the scheduler offers them to fair share
(fair_share.in_turn): arrivals at the back; a preempted sequence, a forked one the
batch had no room for, a request whose remote KV landed, and one the pool could not take
this step at the front. A request with a grammar waits apart until the grammar compiles."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

from pd.contracts.request import Request, RequestStatus
from pd.structured.matchers import GrammarMatchers


class WaitingQueue:
    def __init__(self, grammars: GrammarMatchers) -> None:
        self.grammars = grammars
        self._queue: deque[Request] = deque()
        self.for_grammar: dict[str, Request] = {}  # WAITING_FOR_GRAMMAR, until it compiles

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def add(self, request: Request) -> None:
        """A new request: at the back, or apart while its grammar compiles."""
        if request.sampling_params.grammar is None:
            self._queue.append(request)
            return
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.for_grammar[request.request_id] = request
        self.grammars.compile(request.request_id, request.sampling_params.grammar)

    def put_front(self, request: Request) -> None:
        """A request not in the queue, first in line."""
        self._queue.appendleft(request)

    def to_front(self, request: Request) -> None:
        """A request in the queue keeps its turn: first in line."""
        self._queue.remove(request)
        self._queue.appendleft(request)

    def discard(self, request: Request) -> None:
        """The request leaves the queue (admitted, parked or finished), wherever it waits."""
        if self.for_grammar.pop(request.request_id, None) is None:
            with contextlib.suppress(ValueError):  # not waiting any more
                self._queue.remove(request)

    def compiled(self) -> list[tuple[Request, str]]:
        """Requests whose grammar compiled join the back of the queue, their matchers past
        the tokens a resumed request generated elsewhere; those whose grammar cannot be
        compiled, or does not allow those tokens, are returned with why (aborted
        ones are gone already)."""
        failed = []
        for req_id, error in self.grammars.ready():
            request = self.for_grammar.pop(req_id, None)
            if request is None:
                continue
            error = self._resumed(request) if error is None else f"the request's grammar cannot be compiled: {error}"
            if error is not None:
                failed.append((request, error))
                continue
            request.status = RequestStatus.WAITING
            self._queue.append(request)
        return failed

    def _resumed(self, request: Request) -> str | None:
        """Advance a resumed request's matcher by the tokens it generated elsewhere; why
        not, if its grammar does not allow them."""
        for position, token in enumerate(request.output_token_ids):
            if not self.grammars.accept(request.request_id, token):
                return f"resumed token {position} ({token}) is not allowed by the request's grammar there"
        return None
