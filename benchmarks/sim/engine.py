"""One simulated `pd serve` engine: a waiting queue, a running batch and the requests
whose KV is being read, stepped as the real scheduler steps them (pd/scheduling).

Each step the running requests come first, oldest first: one decoding takes one token, one
still prefilling the next chunk of its prompt, while the step's token budget
(`max_num_batched_tokens`) lasts and, for prompt tokens, the step's prompt budget; then
waiting requests are admitted in order while both budgets and `max_num_seqs` allow. The
prompt budget is the real scheduler's `StepBudget` (`max_step_ms`, step_budget.py): it
learns the step's cost from the simulated steps' times, as the engine from its wall
times, and keeps a prefill chunk beside decodes within the limit. A request whose
prompt's KV comes from a prefill server is parked when admitted (no tokens) and its read
starts; once read, it rejoins the queue's front with P's first token, which goes out at
once, and decodes from there. The step's time is the costs' (`costs.py`) of what it
computes. After the step every request that sampled gets its token; one that has all of
its tokens finishes.

Not modelled: preemption (the KV cache is taken to hold every request), the prefix cache
(every prompt is computed whole), and the max-min fair share between a request's
sequences (every request has one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from benchmarks.sim.costs import StepCosts, attention_of
from pd.scheduling.step_budget import StepBudget
from planner.observe import Counters


class Work(Enum):
    PREFILL = "prefill"  # a prefill server's part: compute the prompt, sample one token, keep the KV for D
    LOCAL = "local"  # compute the prompt and decode every token here (colocated, or D prefilling itself)
    REMOTE = "remote"  # read the prompt's KV from P, then decode from P's first token


@dataclass
class Job:
    """A request's part on one engine."""

    request: object  # the simulation's request: the engine only hands it back
    work: Work
    prompt: int  # prompt tokens
    outputs: int  # tokens this engine's part ends with (P: its one token)
    computed: int = 0
    generated: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt

    @property
    def to_compute(self) -> int:
        return self.num_tokens - self.computed


@dataclass
class Step:
    """One step scheduled: what each request computes, its time, and the reads it starts."""

    scheduled: list[tuple[Job, int]]
    seconds: float
    reads: list[Job]


@dataclass
class Token:
    """A token that went out (first of its request here, or not) and whether it ends the job."""

    job: Job
    finished: bool


@dataclass
class SimEngine:
    costs: StepCosts
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    reading: list[Job] = field(default_factory=list)  # parked for their KV read
    stepping: Step | None = None  # the step under way
    counters: Counters = field(default_factory=lambda: Counters(0.0))  # what its /metrics counts
    step_budget: StepBudget = field(init=False)

    def __post_init__(self) -> None:
        self.step_budget = StepBudget(self.costs.max_num_batched_tokens, self.costs.max_step_ms)

    @property
    def busy(self) -> bool:
        return self.stepping is not None

    @property
    def has_compute_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def schedule(self) -> Step | None:
        """The next step (None when there is nothing to compute); it is under way until `finish`."""
        if self.stepping is not None:
            raise RuntimeError("a step is under way")
        if not self.has_compute_work:
            return None
        budget = self.costs.max_num_batched_tokens
        prompt_budget = self.step_budget.for_step((job.to_compute for job in self.running), len(self.waiting),
                                                  self.costs.max_num_seqs)
        scheduled: list[tuple[Job, int]] = []
        for job in self.running:
            if budget <= 0:
                break
            decoding = job.to_compute == 1
            if not decoding and prompt_budget <= 0:
                continue  # the decodes after it still go
            n = min(job.to_compute, budget if decoding else min(budget, prompt_budget))
            scheduled.append((job, n))
            budget -= n
            prompt_budget -= 0 if decoding else n
        reads = self._admit(scheduled, min(budget, prompt_budget))
        self.step_budget.planned(n for _, n in scheduled)
        tokens = sum(n for _, n in scheduled)
        attention = sum(attention_of(n, job.computed) for job, n in scheduled if job.prefilling)
        decode_attention = sum(attention_of(n, job.computed) for job, n in scheduled if not job.prefilling)
        samples = sum(job.computed + n >= job.num_tokens for job, n in scheduled)
        seconds = self.costs.step_s(tokens, attention, samples, decode_attention) if scheduled else 0.0
        self.stepping = Step(scheduled, seconds, reads)
        return self.stepping

    def _admit(self, scheduled: list[tuple[Job, int]], budget: int) -> list[Job]:
        reads = []
        while self.waiting and budget > 0:
            job = self.waiting[0]
            if len(self.running) >= self.costs.max_num_seqs:
                break
            if job.work is Work.REMOTE and job.prefilling:  # its KV is read first
                self.waiting.popleft()
                self.reading.append(job)
                reads.append(job)
                continue
            self.waiting.popleft()
            self.running.append(job)
            n = min(job.to_compute, budget)
            scheduled.append((job, n))
            budget -= n
        return reads

    def finish(self) -> list[Token]:
        """The step under way ends: the tokens it sampled."""
        step, self.stepping = self.stepping, None
        if step is None:
            raise RuntimeError("no step is under way")
        self.step_budget.took(step.seconds - self.costs.loop_s)  # the engine times its step, not its loop
        c = self.counters
        c.busy_s += step.seconds
        c.steps += 1 if step.scheduled else 0
        tokens = []
        for job, n in step.scheduled:
            c.computed += max(0, min(job.prompt, job.computed + n) - job.computed)
            job.computed += n
            if job.computed >= job.num_tokens:
                tokens.append(self._sampled(job))
        return tokens

    def _sampled(self, job: Job) -> Token:
        job.generated += 1
        self.counters.generated += 1
        done = job.generated >= job.outputs
        if done:
            self.running.remove(job)
            self.counters.finished += 1
        return Token(job, done)

    def landed(self, job: Job, seconds: float) -> Token:
        """The job's KV read (of `seconds`) is done: P's first token goes out now; the job
        decodes the rest from the queue's front."""
        self.reading.remove(job)
        self.counters.xfer_s += seconds
        self.counters.xfers += 1
        job.computed = job.prompt
        job.generated += 1
        self.counters.generated += 1
        if job.generated >= job.outputs:
            self.counters.finished += 1
            return Token(job, True)
        self.waiting.appendleft(job)
        return Token(job, False)
