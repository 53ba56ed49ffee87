"""Progress of long work (loading weights, converting a model, a benchmark's requests,
servers coming up), for an operator: a bar on a terminal, a few plain lines in a log.

On a terminal (`stream.isatty()`) a tqdm bar is redrawn in place, with the counts, the
rate and the time left. Anywhere else (a log file, a pipe, a test's capture) there is
never a carriage return: at most `lines` plain lines in all, one at each tenth (for
`lines=10`) of the total, such as `loading weights: 120/300 tensors (40%, 2.0 s, ~3.0 s
left)`, and the last when the work ends (`... 300/300 tensors (100%) in 5.1 s`). An update
costs a comparison: count per tensor or per request, never per token.

In a process that logs JSON (`PD_LOG_FORMAT=json`, which `pd serve --log-format json` sets
for itself and its engine) the plain lines on stderr are log records instead (logger
`pd.progress`, level info), so that each line there is one JSON object.

In telemetry, on the lowest floor, so that every package (`pd`, the benchmarks, the
deploy scripts) may use it; tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TextIO, TypeVar

from telemetry.logs import ENV_FORMAT

JSON_LOGS = (ENV_FORMAT, "json")  # what telemetry.logs sets for the processes `pd serve` starts
MAX_LINES = 10  # plain lines of one piece of work, the final one included, whatever the total
T = TypeVar("T")


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (False for a closed or fake stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """`done` out of `total` units of one piece of work, shown on `stream` (default:
    sys.stderr at construction). `update` counts, `close` ends it (once; a context
    manager closes it however the block ends). `enabled=False` shows nothing."""

    def __init__(self, what: str, total: int, unit: str = "", stream: TextIO | None = None,
                 lines: int = MAX_LINES, enabled: bool = True) -> None:
        self.what, self.total, self.unit = what, max(0, total), unit
        self.stream = sys.stderr if stream is None else stream
        # a process logging JSON (`--log-format json`) gets its plain lines as log records, so
        # that every line of its stderr is one JSON object
        self._as_log = stream is None and os.environ.get(JSON_LOGS[0]) == JSON_LOGS[1]
        self.done = 0
        self._lines = max(1, lines)
        self._step = 1  # the next plain line is due at step/lines of the total
        self._start = time.monotonic()
        self._closed = not enabled
        self._bar = self._tqdm() if enabled and is_terminal(self.stream) else None

    def _tqdm(self) -> Any:
        from tqdm import tqdm

        return tqdm(total=self.total, desc=self.what, unit=f" {self.unit}" if self.unit else "it",
                    file=self.stream, dynamic_ncols=True, leave=True)

    def update(self, n: int = 1) -> None:
        """Count `n` more units done."""
        self.done += n
        if self._closed:
            return
        if self._bar is not None:
            self._bar.update(n)
        elif self.done < self.total and self.done * self._lines >= self._step * self.total:
            self._step = self.done * self._lines // self.total + 1
            elapsed = time.monotonic() - self._start
            left = elapsed * (self.total - self.done) / self.done
            self._print(f"{self._counts()}, {elapsed:.1f} s, ~{left:.1f} s left)")

    def close(self) -> None:
        """End the work: the bar's last draw, or the final plain line (`... in 5.3 s`)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self._print(f"{self._counts()}) in {time.monotonic() - self._start:.1f} s")

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, one `update` after each is handed out."""
        for item in items:
            yield item
            self.update()

    def _counts(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        percent = f"{100 * self.done // self.total}%" if self.total else "-"
        return f"{self.what}: {self.done}/{self.total}{unit} ({percent}"

    def _print(self, line: str) -> None:
        if self._as_log:
            logging.getLogger("pd.progress").info(line)
            return
        print(line, file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
