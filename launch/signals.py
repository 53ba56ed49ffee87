"""Signals for a launcher that must stop what it started however it ends."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any, NoReturn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_on_signal(signum: int, frame: Any) -> NoReturn:
    # As SystemExit, SIGTERM / SIGHUP unwind through the launcher's `finally` (its teardown).
    raise SystemExit(0)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise SystemExit, SIGINT KeyboardInterrupt: both unwind."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def ignore_stop_signals() -> None:
    """For a teardown, bounded in time: a second Ctrl-C must not cut it short and orphan servers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP until the block ends, then raise KeyboardInterrupt if
    one came (for a step that must not be cut in half, e.g. starting a local Ray cluster)."""
    received: list[int] = []
    handlers = {signum: signal.signal(signum, lambda n, _: received.append(n)) for signum in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if received:
        raise KeyboardInterrupt
