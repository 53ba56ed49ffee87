"""The discrete-event loop: requests arriving at the proxy, engines stepping, KV reads,
answers, and the planner ticking, each at its simulated time.

A request's legs, each an HTTP hop (`hop_s`) where it crosses one: the proxy places it
(`proxy.py`); a prefill server's engine computes its prompt and samples one token, the
proxy hears of it and sends the request to its decode server, whose engine parks it,
reads the prompt's KV (`transfer_s`), sends P's first token when it hears the read is done
(`transfer_polls` step ends after its bytes are in, or at once when idle) and decodes the rest;
or its decode server computes it all (local). Tokens reach the client a hop after the
proxy. A planner tick (every `--interval`, the first one interval in) observes and
decides; a switch reaches the proxy `switch_delay_s` later. Events at one time run in
the order they were scheduled: the run is a function of its inputs alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.serve_metrics import RequestRecord
from benchmarks.sim.costs import StepCosts
from benchmarks.sim.engine import Job, SimEngine, Token, Work
from benchmarks.sim.proxy import Call, SimProxy


@dataclass
class SimRequest:
    arrival: float  # when the client sends it, s
    prompt: int
    output: int
    phase: str
    call: Call | None = None
    first_token: float | None = None
    end: float | None = None

    def record(self, timeout_s: float) -> RequestRecord:
        """As the client measured it (a request that did not end within `timeout_s` failed)."""
        ok = self.end is not None and self.end - self.arrival <= timeout_s
        return RequestRecord(self.prompt, self.arrival, self.end if ok else self.arrival, ok,
                             self.first_token - self.arrival if ok else None, output_len=self.output if ok else 0,
                             error=None if ok else "not answered within the request timeout")


@dataclass
class Tick:
    """The planner's part: `decide(now)` -> the switches to make, each (url, role)."""

    interval_s: float
    decide: Callable[[float], list[tuple[str, str]]]
    switch_delay_s: float = 0.0


@dataclass
class Simulation:
    costs: StepCosts
    proxy: SimProxy
    engines: dict[str, SimEngine]
    requests: list[SimRequest]
    tick: Tick | None = None
    one_host: bool = False  # every engine on one machine: a step beside another engine's takes corun_factor x
    now: float = 0.0
    switches: list[dict] = field(default_factory=list)
    _events: list = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)
    _open: int = 0  # requests not answered yet
    _landings: dict[str, list] = field(default_factory=dict)  # per engine, reads with bytes in: [job, s, polls left]

    def at(self, time: float, action: Callable, *args) -> None:
        heapq.heappush(self._events, (time, next(self._order), action, args))

    def run(self, horizon_s: float) -> None:
        """Until every request is answered, or the clock passes `horizon_s`."""
        for request in self.requests:
            self.at(request.arrival + self.costs.hop_s, self._arrive, request)
        self._open = len(self.requests)
        if self.tick is not None:
            self.at(self.tick.interval_s, self._tick)
        while self._events and self._open and self._events[0][0] <= horizon_s:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)

    def _arrive(self, request: SimRequest) -> None:
        call = request.call = self.proxy.arrive(f"r{id(request)}", request.prompt)
        if self.proxy.disaggregated(call):
            prefill = self.proxy.send_prefill(call)
            self._send(prefill.url, Job(request, Work.PREFILL, request.prompt, 1))
        else:
            decode = self.proxy.open_decode(call)
            self._send(decode.url, Job(request, Work.LOCAL, request.prompt, request.output))

    def _send(self, url: str, job: Job) -> None:
        self.at(self.now + self.costs.hop_s, self._enqueue, url, job)

    def _enqueue(self, url: str, job: Job) -> None:
        engine = self.engines[url]
        engine.add(job)
        self._kick(url, engine)

    def _kick(self, url: str, engine: SimEngine) -> None:
        """Start the engine's next step if it is idle and has something to compute."""
        while not engine.busy:
            step = engine.schedule()
            if step is None:
                if not self._hear(url, engine, polls=None):
                    return
                continue
            for job in step.reads:
                seconds = self.costs.transfer_s(job.prompt)
                self.at(self.now + seconds, self._landed, url, job, seconds)
            if step.scheduled:
                if self.one_host and any(other.busy for other in self.engines.values() if other is not engine):
                    step.seconds *= self.costs.corun_factor
                self.at(self.now + step.seconds, self._stepped, url)
                return
            engine.finish()  # it only parked requests for their reads

    def _stepped(self, url: str) -> None:
        engine = self.engines[url]
        for token in engine.finish():
            self._token(token)
        self._hear(url, engine, polls=1)
        self._kick(url, engine)

    def _landed(self, url: str, job: Job, seconds: float) -> None:
        """A read's bytes are in; a busy engine hears of it at its `transfer_polls`-th step
        end from now (each step end polls it once), an idle one at once (it polls back to back)."""
        self._landings.setdefault(url, []).append([job, seconds, self.costs.transfer_polls])
        engine = self.engines[url]
        if not engine.busy:
            self._kick(url, engine)

    def _hear(self, url: str, engine: SimEngine, polls: int | None) -> bool:
        """The engine polls its reads whose bytes are in, `polls` times (None: until each is
        heard of); True if it heard of one."""
        heard, left = False, []
        for landing in self._landings.pop(url, []):
            landing[2] = 0 if polls is None else landing[2] - polls
            if landing[2] > 0:
                left.append(landing)
                continue
            self._token(engine.landed(landing[0], landing[1]))
            heard = True
        if left:
            self._landings[url] = left
        return heard

    def _token(self, token: Token) -> None:
        request: SimRequest = token.job.request
        if token.job.work is Work.PREFILL:
            self.at(self.now + self.costs.hop_s, self._prefilled, request)
            return
        seen = self.now + 2 * self.costs.hop_s  # to the proxy, then to the client
        if request.first_token is None:
            request.first_token = seen
        if token.finished:
            request.end = seen
            self.at(self.now + self.costs.hop_s, self._answered, request)

    def _prefilled(self, request: SimRequest) -> None:
        self.proxy.prefilled(request.call)
        decode = self.proxy.open_decode(request.call)
        self._send(decode.url, Job(request, Work.REMOTE, request.prompt, request.output))

    def _answered(self, request: SimRequest) -> None:
        self.proxy.answered(request.call)
        self._open -= 1

    def _tick(self) -> None:
        for switch in self.tick.decide(self.now):
            self.at(self.now + self.tick.switch_delay_s, self._switch, *switch)
        self.at(self.now + self.tick.interval_s, self._tick)

    def _switch(self, url: str, role: str) -> None:
        if self.proxy.switch(url, role):
            self.switches.append({"at_s": round(self.now, 3), "url": url, "role": role})
