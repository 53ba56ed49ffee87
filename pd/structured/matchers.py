"""The engine's grammar matchers (llguidance), one per request with a grammar.

A grammar is compiled off the step, in a thread of its own (llguidance releases the GIL
while compiling) with a 256 MiB stack, 16 times what the server's checker validated it
with (checker.py: a grammar deep enough to overflow one crashes the process), once per
distinct grammar: later requests with the same one start from a copy of the compiled
matcher. The tokenizer llguidance needs is built in that thread
too, at the first grammar. Each step the scheduler takes the requests whose grammar is
ready (`ready`), asks for the mask of the tokens allowed next for each request about to
sample (`masks`, one bit per token), and hands every token sampled to its matcher
(`accept`); a matcher that has reached the end of its grammar (`is_stopped`) ends the
request. A request forking into n sequences gives each a copy of its matcher (`fork`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pd.structured.grammar import Grammar, GrammarError

logger = logging.getLogger(__name__)

MAX_COMPILED = 64  # distinct grammars kept compiled (least recently used dropped first)
COMPILE_STACK_BYTES = 256 << 20  # reserved, not committed: only what recursion touches is used


class GrammarMatchers:
    """`tokenizer_json` gives the tokenizer.json text llguidance builds its tokenizer
    from (None: this engine cannot compile grammars, and says so per request)."""

    def __init__(self, tokenizer_json: Callable[[], str] | None, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer = None  # built in the pool's thread
        self._compiled: OrderedDict[Grammar, Future] = OrderedDict()
        self._compiling: dict[str, Future] = {}
        self._matchers: dict[str, object] = {}

    # ---- compiling ------------------------------------------------------------------

    def compile(self, request_id: str, grammar: Grammar) -> None:
        """Start compiling `grammar` for the request (or reuse it compiled)."""
        future = self._compiled.get(grammar)
        if future is None:
            if self._pool is None:
                self._pool = _pool_with_stack(COMPILE_STACK_BYTES)
            future = self._pool.submit(self._compile, grammar)
            self._compiled[grammar] = future
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        self._compiling[request_id] = future

    def ready(self) -> list[tuple[str, str | None]]:
        """Requests whose grammar finished compiling since the last call, each with the
        reason it could not be compiled (None: it has its matcher now)."""
        done = [(request_id, future) for request_id, future in self._compiling.items() if future.done()]
        results = []
        for request_id, future in done:
            del self._compiling[request_id]
            try:
                self._matchers[request_id] = future.result().deep_copy()
                results.append((request_id, None))
            except Exception as e:  # GrammarError, or anything llguidance raised
                results.append((request_id, str(e)))
        return results

    def _compile(self, grammar: Grammar):
        import llguidance

        if self._tokenizer_json is None:
            raise GrammarError("this engine has no tokenizer to compile grammars with")
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), eos_token=self._eos_token_ids)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar.llguidance(), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    # ---- matching -------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def masks(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """For each request, the tokens its grammar allows next: int32 words, bit j of
        word w for token 32 w + j. A matcher that failed (a grammar past llguidance's
        limits) allows every token: its request then fails at its next token (`accept`),
        alone, where a row with nothing allowed would disturb the batch's sampling."""
        if not request_ids:
            return {}
        import llguidance.numpy as llg_numpy

        bitmask = llg_numpy.allocate_token_bitmask(len(request_ids), self._tokenizer.vocab_size)
        for row, request_id in enumerate(request_ids):
            matcher = self._matchers[request_id]
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
            if matcher.is_error():
                bitmask[row] = -1
        return dict(zip(request_ids, bitmask))

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by a token; False if its grammar does not allow
        it (the matcher is then unusable). True for a request without a grammar."""
        matcher = self._matchers.get(request_id)
        return matcher is None or bool(matcher.consume_token(token_id))

    def is_stopped(self, request_id: str) -> bool:
        """The request's output is complete under its grammar (nothing more may follow)."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_stopped()

    def fork(self, request_id: str, child_id: str) -> None:
        """The child starts from a copy of the request's matcher as it is now."""
        matcher = self._matchers.get(request_id)
        if matcher is not None:
            self._matchers[child_id] = matcher.deep_copy()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._compiling.pop(request_id, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _pool_with_stack(stack_bytes: int) -> ThreadPoolExecutor:
    """A one-thread pool whose thread has a stack of `stack_bytes` (the size applies to
    threads started while it is set: the pool's is started here, by a first task)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="pd-grammar")
    previous = threading.stack_size(stack_bytes)
    try:
        pool.submit(lambda: None).result()
    finally:
        threading.stack_size(previous)
    return pool
