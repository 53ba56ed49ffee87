"""Grammars checked where a crash costs only the request that brought it.

llguidance is native code: a grammar deep enough overflows its stack and kills the
process it runs in (a Lark grammar of ~2,750 chained rules did, in the server's API
process; the proxy then retried the request on the next prefill server and killed it
too). So a server never runs llguidance on a client's grammar itself. It first holds
the grammar to `limits` (size, Lark rules, JSON nesting and `$ref`s: a 400 naming the
limit), then asks a checker process of its own, which validates it in a thread with a
16 MiB stack (the engine compiles in one of 256 MiB, `matchers.py`: what passes here
compiles there). A checker that dies or takes longer than `timeout_s` fails that
request's grammar alone (a 400) and is replaced for the next one.

The checker process is started at the first grammar (its `timeout_s` starts once it
says it is ready: a slow start is not the grammar's) and takes one grammar at a time
(several API threads wait their turn, without holding a prepare slot: serving.py).
Verdicts are kept for the last `CACHE_SIZE` distinct grammars, so a schema sent with
every request is checked once; llguidance's answers and crashes are kept, a timeout is
not (a loaded machine may be the cause). Only bytes cross the pipe (msgpack), both ways.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec

from pd.structured.grammar import Grammar, GrammarError
from pd.structured.limits import check_limits

logger = logging.getLogger(__name__)

CHECK_STACK_BYTES = 16 << 20  # the checker's validating thread; the engine compiles with 16x this
CHECK_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0  # for a new checker process to import llguidance and say so
READY = b"ready"
CACHE_SIZE = 256


class _Verdict(msgspec.Struct, frozen=True):
    error: str | None  # why llguidance cannot compile the grammar; None: it can


_grammar_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Grammar))
_verdict_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_Verdict))


class GrammarChecker:
    """`check(grammar)` raises GrammarError unless llguidance can compile the grammar,
    run in a process that may die for it. Thread-safe."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._verdicts: OrderedDict[Grammar, str | None] = OrderedDict()
        self.crashes = 0  # checker processes a grammar killed or hung

    def check(self, grammar: Grammar) -> None:
        check_limits(grammar)
        with self._lock:
            if grammar in self._verdicts:
                self._verdicts.move_to_end(grammar)
                error = self._verdicts[grammar]
            else:
                error, keep = self._ask(grammar)
                if keep:
                    self._verdicts[grammar] = error
                    if len(self._verdicts) > CACHE_SIZE:
                        self._verdicts.popitem(last=False)
        if error is not None:
            raise GrammarError(error)

    def _ask(self, grammar: Grammar) -> tuple[str | None, bool]:
        """The checker's verdict (a crash or a timeout is a verdict too), and whether it
        is the grammar's for good (a timeout may be the machine's)."""
        try:
            conn = self._connection()
        except (EOFError, OSError, TimeoutError) as e:
            self._stop()
            return f"the grammar checker did not start ({e})", False
        try:
            conn.send_bytes(_grammar_codec[0].encode(grammar))
            if conn.poll(self.timeout_s):
                return _verdict_codec[1].decode(conn.recv_bytes()).error, True
            why, keep = f"checking it took longer than {self.timeout_s:g} s", False
        except (EOFError, OSError):  # it died checking this grammar
            why, keep = "it crashed the grammar library (too deep or too large)", True
        self.crashes += 1
        logger.warning("grammar checker process %s: %s; starting another for the next grammar",
                       self._process.pid if self._process else None, why)
        self._stop()
        return why, keep

    def _connection(self) -> Connection:
        """The pipe to a checker process that is ready (started now if there is none)."""
        if self._process is None or not self._process.is_alive():
            self._stop()
            parent, child = multiprocessing.get_context("spawn").Pipe()
            self._process = multiprocessing.get_context("spawn").Process(
                target=_serve, args=(child,), name="pd-grammar-checker", daemon=True)
            self._process.start()
            child.close()
            self._conn = parent
            if not parent.poll(START_TIMEOUT_S) or parent.recv_bytes() != READY:
                raise TimeoutError(f"not ready in {START_TIMEOUT_S:g} s")
        return self._conn

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        self._process = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _serve(conn: Connection) -> None:
    """The checker process: a verdict for each grammar received, until the pipe closes."""
    importlib.import_module("llguidance")  # before saying it is ready: the import is most of a start

    threading.stack_size(CHECK_STACK_BYTES)
    conn.send_bytes(READY)
    while True:
        try:
            grammar = _grammar_codec[1].decode(conn.recv_bytes())
        except (EOFError, OSError):
            return
        verdict: list[str | None] = [None]
        thread = threading.Thread(target=_validate, args=(grammar, verdict))
        thread.start()
        thread.join()
        conn.send_bytes(_verdict_codec[0].encode(_Verdict(verdict[0])))


def _validate(grammar: Grammar, verdict: list[str | None]) -> None:
    try:
        grammar.check()
    except GrammarError as e:
        verdict[0] = str(e)
    except Exception as e:  # whatever llguidance raised: the grammar's
        verdict[0] = f"{type(e).__name__}: {e}"
