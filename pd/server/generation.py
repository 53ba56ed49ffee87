"""One request's run through the engine, as the server follows it: its sequences (n of
them when it asked for several), detokenized and cut at stop strings, their logprobs,
and the latency metrics. Knows nothing of HTTP; `responses.py` shapes what it produces.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from pd.contracts.request import RequestTimes, cached_tokens, sequence_id
from pd.kv_transfer.params import RemotePrefillParams
from pd.logprobs import Logprobs, PromptLogprobs
from pd.server.detokenize import IncrementalDetokenizer
from pd.server.metrics import ServerMetrics
from pd.server.serving import Prepared
from pd.server.spans import RequestSpan
from wire.codes import MIGRATED


def prompt_tokens_details(sources: dict[str, int]) -> dict[str, Any]:
    """`usage.prompt_tokens_details`: `cached_tokens` as OpenAI's clients read it, and
    `sources`, how many prompt tokens came from where (`computed`, `local_cache`,
    `remote`: another server's cache, `host` / `disk`: an offload tier). Under PD they are
    the prefill server's: it computed for this request what the decode server read."""
    return {"cached_tokens": cached_tokens(sources), "sources": dict(sources)}


@dataclass
class Delta:
    """New text of one sequence, the token ids that arrived since its last delta and
    their logprobs (when asked for); `finish_reason` set on its last delta."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    index: int = 0
    logprobs: Logprobs | None = None


@dataclass
class Sequence:
    """One sequence of the request, as far as it has come: every token, the text
    released, their logprobs (when asked for) and how it ended."""

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: Logprobs | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    _pending: Delta = field(default_factory=lambda: Delta(""))

    def add(self, out: Any, release_token_ids: bool) -> Delta | None:
        """Take an engine output; the delta it releases, if any (text, or token ids when
        they are asked for, or the end). A stop string ends the sequence here."""
        self.token_ids += out.new_token_ids
        pending = self._pending
        pending.token_ids += out.new_token_ids
        if self.logprobs is not None and out.logprobs is not None:
            self.logprobs.append(out.logprobs)
            pending.logprobs = pending.logprobs or Logprobs()
            pending.logprobs.append(out.logprobs)
        text = self.detokenizer.add(out.new_token_ids)
        if self.detokenizer.stopped or out.finish_reason is not None:
            text += self.detokenizer.finish()
            self.finish_reason = "stop" if self.detokenizer.stopped else out.finish_reason
        elif not (text or (pending.token_ids and release_token_ids)):
            return None
        self.text += text
        self._pending = Delta("", index=self.index)
        return Delta(text, pending.token_ids, self.finish_reason, self.index, pending.logprobs)

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its sampled tokens' logprobs (what best_of ranks by)."""
        return sum(row[0] for row in self.logprobs.logprobs) if self.logprobs is not None else 0.0


@dataclass
class Generation:
    """One request's run through the engine. Iterate `deltas()` once; afterwards the
    sequences, counts and `kv_transfer_params` describe how it went. A sequence cut by a
    stop string is aborted in the engine; leaving the iteration early (a cancelled task)
    closes the engine stream, which aborts every sequence there and frees their blocks."""

    client: Any
    tokenizer: Any
    prepared: Prepared
    metrics: ServerMetrics
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))  # the responses' `created`
    num_output_tokens: int = 0
    prompt_sources: dict[str, int] = field(default_factory=dict)  # where the prompt's KV came from
    kv_transfer_params: RemotePrefillParams | None = None
    exports: dict[int, RemotePrefillParams | None] = field(default_factory=dict)  # sequences handed on: their KV
    prompt_logprobs: PromptLogprobs | None = None
    sequences: list[Sequence] = field(init=False)
    span: RequestSpan | None = None  # with tracing on
    times: RequestTimes | None = None  # the engine's, from the finishing output
    _last_token_time: float | None = None

    def __post_init__(self) -> None:
        params = self.prepared.engine_request.sampling_params
        resumed = self.prepared.resumed
        if resumed is not None:  # each sequence as far as another server took it
            self.sequences = [Sequence(j, c.detokenizer, Logprobs() if params.logprobs is not None else None,
                                       list(c.token_ids), c.detokenizer.text[:c.detokenizer.released],
                                       c.finish_reason)
                              for j, c in enumerate(resumed.choices)]
            self.num_output_tokens = sum(len(c.token_ids) for c in resumed.choices)
            return
        self.sequences = [Sequence(i, IncrementalDetokenizer(self.tokenizer, self.prepared.stop,
                                                             min_tokens=params.min_tokens),
                                   Logprobs() if params.logprobs is not None else None)
                          for i in range(params.n)]

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of every sequence as they come: new text (or, when token ids were asked
        for, new token ids), and each sequence's finishing one."""
        outputs = self.client.generate(self.prepared.engine_request)
        try:
            async for out in outputs:
                self._observe(out)
                sequence = self.sequences[out.index]
                if sequence.finish_reason is not None:
                    continue  # cut by a stop string here: what the engine sent after is dropped
                if out.times is not None:
                    self.times = out.times
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = out.prompt_logprobs
                if out.finish_reason == MIGRATED:  # paused here, to go on elsewhere from its KV
                    self.exports[out.index] = out.kv_transfer_params
                    if self.finished:
                        return
                    continue
                if out.finish_reason is not None and out.kv_transfer_params is not None:
                    self.kv_transfer_params = out.kv_transfer_params
                delta = sequence.add(out, self.prepared.return_token_ids)
                if delta is not None:
                    yield delta
                if self.finished:
                    self._observe_end()
                    return
                if sequence.finish_reason is not None and out.finish_reason is None:
                    await self.client.abort([sequence_id(self.prepared.engine_request.request_id, out.index)])
        finally:
            # Shielded: under a cancelled scope (client gone) the abort must still be sent.
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
            self.end_span()

    def end_span(self) -> None:
        """End the request's span, if traced (idempotent)."""
        if self.span is not None:
            self.span.finish(self.times, self.num_output_tokens, self.prompt_sources,
                             self.sequences[0].finish_reason or (MIGRATED if self.migrated else None))

    @property
    def finished(self) -> bool:
        """Every sequence ended, or was handed on (`migrated`)."""
        return all(s.finish_reason is not None or s.index in self.exports for s in self.sequences)

    @property
    def migrated(self) -> bool:
        """Some of its sequences were handed on: the answer goes on at another server."""
        return bool(self.exports)

    def _observe(self, out: Any) -> None:
        if out.prompt_sources:
            self.prompt_sources = out.prompt_sources
        n = len(out.new_token_ids)
        if not n:
            return
        now = time.monotonic()
        if self._last_token_time is None:
            if self.prepared.resumed is None:  # a resumed stream's first token came from another server
                self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            for _ in range(n):
                self.metrics.inter_token_latency.observe((now - self._last_token_time) / n)
        self._last_token_time = now
        self.num_output_tokens += n
        self.metrics.generation_tokens.inc(n)

    def _observe_end(self) -> None:
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(self.prepared.num_prompt_tokens)
        self.metrics.request_success.labels(finish_reason=self.sequences[0].finish_reason).inc()

    @property
    def transfer_params_json(self) -> dict[str, Any] | None:
        return None if self.kv_transfer_params is None else self.kv_transfer_params.to_json()

    def usage(self) -> dict[str, Any]:
        prompt = self.prepared.num_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.num_output_tokens,
                "total_tokens": prompt + self.num_output_tokens,
                "prompt_tokens_details": prompt_tokens_details(self.prompt_sources)}
