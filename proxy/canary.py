"""The PD canary (`--canary-fraction F`): does prefill/decode disaggregation answer what
one server alone would?

A sampled fraction of the requests that take a PD path (disaggregated, with or without
reuse) and whose tokens are fixed by their body (greedy, `temperature` 0, or `seed` set;
one sequence) is run again, once the client's answer is complete, colocated: the same
body to one server alone (`kv_transfer_params` absent), another instance than the PD
request's P and D where there is one. The two answers' token ids are compared:

- to see the PD answer's, D is asked for them (`return_token_ids`) and, when the client
  did not ask, they are taken out of what the client gets (`Tap`, tap.py);
- the reference is asked for them and, at each token, the ids and logprobs of the two
  most likely tokens (`logprobs`, read by id from `top_token_ids`).

At the first position where they differ the outcome is a **tie** when the PD token is
one of the reference's two most likely there and its logprob is within `--canary-tie-
logprob` (ε, default 0.05) of the reference token's: the two are about as likely, and
arithmetic that differs in its last bits (another batch, another chunking) may pick
either. Otherwise it is a **mismatch** (answers of different lengths with one a prefix
of the other too). Outcomes are counted (`pd_proxy_canary_total{result}`), a mismatch is
logged with both request ids, and each canary is a `proxy.canary` span in the request's
trace (its result, the position, an event on a mismatch).

What it costs real traffic is bounded: at most `--canary-max-inflight` canaries run at
once (a request whose answer ends beyond that is counted `skipped` and not run), they are sent
after the client's answer ended (never delaying it), outside the proxy's queue and
`--max-outstanding` accounting, and never to a server at its `--max-outstanding`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import httpx

from proxy.calls import Call
from proxy.instances import Instance
from proxy.tap import Tap
from telemetry import tracing
from wire.headers import REQUEST_ID
from wire.kv_params import KV_TRANSFER_PARAMS

logger = logging.getLogger(__name__)

RESULTS = ("match", "tie", "mismatch", "error", "skipped")
TIE_LOGPROB = 0.05
TOP = 2  # the reference's most likely tokens a PD token may be tied with


def pins_tokens(body: dict[str, Any]) -> bool:
    """Whether the body fixes its tokens (greedy or seeded) for one sequence."""
    greedy = body.get("temperature") in (0, 0.0)
    seeded = isinstance(body.get("seed"), int) and not isinstance(body.get("seed"), bool)
    one = body.get("n", 1) in (1, None) and body.get("best_of", 1) in (1, None)
    return (greedy or seeded) and one


def reference_body(body: dict[str, Any]) -> dict[str, Any]:
    """The canary's request: the client's body, unstreamed, alone (no PD parameters),
    asking for token ids and at least the two most likely tokens' logprobs."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", KV_TRANSFER_PARAMS)}
    out["return_token_ids"] = True
    if "messages" in out:
        out["logprobs"] = True
        out["top_logprobs"] = max(TOP, out.get("top_logprobs") or 0)
    else:
        given = out.get("logprobs")
        out["logprobs"] = max(TOP, given if isinstance(given, int) and not isinstance(given, bool) else 0)
    return out


def compare(pd_ids: list[int], ref_ids: list[int], ref_rows: list[list[list[float]]],
            tie_logprob: float) -> tuple[str, int | None]:
    """("match" | "tie" | "mismatch", the first position that differs)."""
    for position, (ours, theirs) in enumerate(zip(pd_ids, ref_ids)):
        if ours == theirs:
            continue
        row = ref_rows[position] if position < len(ref_rows) else []
        chosen = row[0][1] if row else None
        likely = {int(token): value for token, value in row[1:1 + TOP]}
        tied = chosen is not None and ours in likely and abs(chosen - likely[ours]) <= tie_logprob
        return ("tie" if tied else "mismatch"), position
    if len(pd_ids) != len(ref_ids):
        return "mismatch", min(len(pd_ids), len(ref_ids))
    return "match", None


class Canaries:
    """Which requests get a canary, and the canaries running (at most `max_inflight`)."""

    def __init__(self, fraction: float, max_inflight: int, tie_logprob: float, count: Callable[[str], None],
                 draw: Callable[[], float] = random.random) -> None:
        self.fraction = fraction
        self.max_inflight = max_inflight
        self.tie_logprob = tie_logprob
        self.count = count  # the metric: one per outcome
        self.draw = draw
        self.inflight = 0
        self._tasks: set[asyncio.Task] = set()

    def samples(self, call: Call) -> bool:
        """Whether the canary takes this PD request."""
        return self.fraction > 0 and pins_tokens(call.body) and self.draw() < self.fraction

    def done(self, tap: Tap, ok: bool, run: Callable[[], Any]) -> None:
        """The PD answer ended (`ok`: sent whole): run its canary in the background, unless
        `max_inflight` run already (counted skipped) or the answer said nothing of its
        tokens (a failure)."""
        if not ok or tap.broken is not None or tap.finish_reason is None:
            return
        if self.inflight >= self.max_inflight:
            self.count("skipped")
            return
        self.inflight += 1
        task = asyncio.ensure_future(self._run(run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, run: Callable[[], Any]) -> None:
        try:
            self.count(await run())
        except Exception:  # a canary never fails anything but itself
            logger.exception("the canary failed")
            self.count("error")
        finally:
            self.inflight -= 1


async def check(client: httpx.AsyncClient, call: Call, tap: Tap, target: Instance | None, headers: dict[str, str],
                timeout: httpx.Timeout, tie_logprob: float, parent: Any = None) -> str:
    """Run `call` colocated on `target` and compare with the PD answer `tap` read; the
    outcome. With tracing on, a `proxy.canary` span in `parent`'s trace (the request's)."""
    span = tracing.start("proxy.canary", parent=parent, attributes={"pd.request_id": call.request_id}) \
        if parent is not None else None
    try:
        result, position, reference_id = await _reference(client, call, tap, target, headers, timeout, tie_logprob)
        if span is not None:
            span.set_attributes({"pd.canary.result": result, "pd.canary.reference_request_id": reference_id,
                                 **({"pd.canary.position": position} if position is not None else {}),
                                 **({"pd.instance": target.url} if target is not None else {})})
            if result == "mismatch":
                span.add_event("canary mismatch", {"pd.canary.position": position})
        if result == "mismatch":
            logger.warning("canary mismatch: request %s (PD) and %s (alone on %s) differ at token %d",
                           call.request_id, reference_id, target.url, position)
        return result
    finally:
        if span is not None:
            span.end()


async def _reference(client: httpx.AsyncClient, call: Call, tap: Tap, target: Instance | None,
                     headers: dict[str, str], timeout: httpx.Timeout,
                     tie_logprob: float) -> tuple[str, int | None, str | None]:
    if target is None:
        return "skipped", None, None
    reference_id = f"{call.request_id}-canary"
    try:
        response = await client.post(target.url + call.endpoint, json=reference_body(call.body),
                                     headers=headers | {REQUEST_ID: reference_id}, timeout=timeout)
        choice = response.json()["choices"][0] if response.status_code == 200 else None
        ids, rows = list(choice["token_ids"]), choice.get("top_token_ids") or []
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        logger.info("the canary of request %s got no answer from %s: %s", call.request_id, target.url, exc)
        return "error", None, reference_id
    result, position = compare(tap.token_ids, ids, rows, tie_logprob)
    return result, position, reference_id
