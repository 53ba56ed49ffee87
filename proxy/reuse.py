"""The `disaggregated+reuse` path (`disagg.py`): a prefill server reads from the decode
server the prefix of the prompt that D holds and P lacks (a conversation's earlier turns
and D's answers), and computes only the rest.

1. The proxy has D export the prefix (`export_body`: a one-token completion of the
   prefix's token ids, kept for a reader): D finds it in its prefix cache, computes its
   last block at most, and keeps its blocks under a lease, answering
   `kv_transfer_params` signed as a prefill server's are.
2. P gets the request with `kv_transfer_params: {"do_remote_decode": true, "prefix":
   D's parameters}`: it reads what of the prefix it lacks from D (NIXL, the lease word
   checked as D checks P's) and tells D it is done, which frees the export.
3. D gets P's parameters as on the disaggregated path and reads from P only what it lacks.

Nothing here can fail a request that the disaggregated path would serve: when D does not
export (unreachable, an error, no room to hold), P is asked as usual; when P refuses the
prefix (403 or 400 naming `kv_transfer_params.prefix`), the export is released and P is
asked again without it; a prefix P takes but cannot read (D gone, its blocks gone, a
read timing out) P computes itself. When P does not answer the request well, the export
is released at once (else D frees it when its lease ends).
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
from fastapi.responses import Response

from proxy.body import export_body
from proxy.calls import Call, NoRoom, Prefilled, Unreached
from proxy.instances import Instance
from proxy.upstream import Upstream
from wire.headers import REQUEST_ID
from wire.kv_params import DO_REMOTE_PREFILL, KV_TRANSFER_PARAMS

logger = logging.getLogger(__name__)

EXPORT_PATH = "/v1/completions"  # the prefix goes as token ids, whatever the client's endpoint
PREFIX_FIELD = "kv_transfer_params.prefix"
_releasing: set[asyncio.Task] = set()  # releases of exports whose request was cancelled


async def prefill_reusing(upstream: Upstream, call: Call, decode: Instance,
                          num_tokens: int) -> Prefilled | NoRoom | Unreached | Response:
    """`Upstream.prefill_once`, P reading the first `num_tokens` of the prompt from `decode`."""
    export = await _export(upstream, call, decode, num_tokens)
    if export is None:
        upstream.metrics.reuse_fallbacks.labels(reason="export").inc()
        return await upstream.prefill_once(call)
    call.prefix = export.params
    try:
        answer = await upstream.prefill_once(call)
        if _refuses_prefix(answer):
            logger.warning("a prefill server refused the prefix exported by %s: %s", decode.url, answer.body[:300])
            upstream.metrics.reuse_fallbacks.labels(reason="refused").inc()
            await upstream.release(export, call.headers)
            call.prefix, export = None, None
            answer = await upstream.prefill_once(call)
    except asyncio.CancelledError:  # the client left: D's export is nobody's
        if export is not None:
            task = asyncio.ensure_future(upstream.release(export, call.headers))
            _releasing.add(task)
            task.add_done_callback(_releasing.discard)
        raise
    if export is not None and not isinstance(answer, Prefilled):
        await upstream.release(export, call.headers)
    return answer


async def _export(upstream: Upstream, call: Call, decode: Instance, num_tokens: int) -> Prefilled | None:
    """D's parameters for the first `num_tokens` of the prompt, kept for a reader; None
    when D did not export them (logged)."""
    body = export_body(call.body, call.route.tokens[:num_tokens])
    headers = call.headers | {REQUEST_ID: f"{call.request_id}-export"}
    decode.outstanding += 1
    try:
        response = await upstream.client.post(decode.url + EXPORT_PATH, json=body, headers=headers,
                                              timeout=upstream.prefill_timeout)
        params = response.json().get(KV_TRANSFER_PARAMS) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.warning("the decode server %s did not export a prefix: %s: %s", decode.url, type(exc).__name__, exc)
        return None
    finally:
        decode.outstanding -= 1
    if not isinstance(params, dict) or params.get(DO_REMOTE_PREFILL) is not True:
        logger.warning("the decode server %s did not export a prefix: HTTP %d %s", decode.url,
                       response.status_code, response.text[:300])
        return None
    return Prefilled(decode, params)


def _refuses_prefix(answer: object) -> bool:
    """Whether P's answer refuses the request for its prefix (a 4xx naming it)."""
    if not isinstance(answer, Response) or not 400 <= answer.status_code < 500:
        return False
    try:
        error = json.loads(answer.body).get("error")
        return isinstance(error, dict) and str(error.get("param", "")).startswith(PREFIX_FIELD)
    except (ValueError, AttributeError):
        return False
