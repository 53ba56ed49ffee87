"""A circuit breaker per server: which servers the proxy sends requests to.

- closed: requests go to it. `threshold` failures in a row (a request that could not
  reach it or that it failed as a server: no connection, a timeout, a dead engine, a
  5xx) open it.
- open: nothing is sent to it for `cooldown_s`; then it is half-open.
- half-open: one trial at a time (a client's request, or the prober's /health); a
  success closes it, a failure opens it again for another cool-down.

A success in the closed state resets the count. The clock is passed in (monotonic
seconds), so the breaker is tested without waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STATES = ("closed", "half_open", "open")  # the gauge's values 0, 1, 2


@dataclass
class Breaker:
    threshold: int = 1
    cooldown_s: float = 5.0
    state: str = "closed"
    failures: int = 0  # in a row
    opened_at: float = 0.0
    trial: bool = False  # a half-open trial is under way
    clock: object = field(default=time.monotonic, repr=False)

    def allows(self) -> bool:
        """Whether a request may be sent now (moves an open breaker past its cool-down
        to half-open)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self.state, self.trial = "half_open", False
        return self.state == "closed" or (self.state == "half_open" and not self.trial)

    def start(self) -> None:
        """A request is sent (a half-open breaker lets no other through meanwhile)."""
        if self.state == "half_open":
            self.trial = True

    def finish(self) -> None:
        """A request sent has ended; `succeeded` or `failed` follows if it said anything
        of the server (a client that left says nothing: another trial may go)."""
        self.trial = False

    def succeeded(self) -> None:
        self.state, self.failures, self.trial = "closed", 0, False

    def failed(self) -> bool:
        """Count a failure; True if the breaker opened now."""
        self.failures += 1
        self.trial = False
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.threshold):
            self.state, self.opened_at = "open", self.clock()
            return True
        return False

    @property
    def gauge(self) -> int:
        return STATES.index(self.state)
