"""Where a request's prompt is computed: on a prefill server (disaggregated) or on the
decode server itself (local), per `--disagg-policy`.

- `always`: every request is prefilled on a P; D pulls the blocks it lacks.
- `conditional`: the decode server is picked first, as always; then D prefills the
  request itself (the request goes to it without `kv_transfer_params`, as to a colocated
  server) when
  - what D lacks of the prompt, the prompt tokens minus those its KV events say it holds
    (`Instance.overlap_tokens`), is at most `--local-prefill-max-tokens`: the next turn of
    a conversation D decoded, whose earlier turns and answers D holds; or
  - the prompt tokens already queued on the least loaded prefill server (those it has to
    work through for requests in flight) exceed what D lacks: waiting for P alone would
    cost more than D computing the request; or
  - no prefill server is healthy (rather than a 503); and `forward.py` falls back to D
    likewise when the prefill servers tried could not be reached (nothing was sent).
    A P that took the request and failed is not: the request may be what failed it.

  Otherwise P prefills it, as under `always`; and when D holds at least
  `--reuse-min-tokens` more of the prompt than any healthy P is known to (`reuse_tokens`:
  a conversation's earlier turns and answers, which P never saw), P reads that prefix
  from D first (`disaggregated+reuse`, `reuse.py`) and computes only the rest. The prompt's tokens are needed (the proxy
  tokenizes it, as for kv_aware), and D's events: without `--kv-events-port` on D, D
  holds nothing as far as the proxy knows and only short prompts are computed there.
"""

from __future__ import annotations

from proxy.instances import Instance, InstancePool, Route

DISAGG_POLICIES = ("always", "conditional")
LOCAL, DISAGGREGATED, REUSE = "local", "disaggregated", "disaggregated+reuse"
PATHS = (LOCAL, DISAGGREGATED, REUSE)
LOCAL_PREFILL_MAX_TOKENS = 256  # measured: see the README (conditional disaggregation)
REUSE_MIN_TOKENS = 128  # a read from D costs D a round trip and one block's compute; P computing this many, more


def choose_path(route: Route, decode: Instance, prefill: InstancePool, policy: str, local_max_tokens: int,
                reuse_min_tokens: int = 0) -> str:
    """LOCAL, DISAGGREGATED or REUSE for a request whose decode server is `decode`."""
    lacking = decode.lacking_tokens(route)
    if policy != "conditional" or lacking is None:
        return DISAGGREGATED
    if lacking <= local_max_tokens:
        return LOCAL
    available = [i for i in prefill.instances if i.available]
    if not available or min(prefill.load_tokens(i) for i in available) > lacking:
        return LOCAL
    return REUSE if reuse_tokens(route, decode, prefill, reuse_min_tokens) else DISAGGREGATED


def reuse_tokens(route: Route, decode: Instance, prefill: InstancePool, min_tokens: int) -> int:
    """The prompt tokens D exports for P to read (0: none): the full blocks of the prompt
    D holds, short of its last token (P computes at least that one), when they are at
    least `min_tokens` (> 0) more than the healthy P holding most holds by its events.
    Those name the routing group's blocks (full attention), and a P reading a prefix
    reads what its full-attention hit lacks, whatever its sliding-window or Mamba groups
    hold (they are left out of that hit, as D's are for a remote prefill): where a P's
    events cover D's blocks, a read would move nothing. (Counting a hybrid's P as holding
    nothing, as this did, sent every next turn of a conversation it had prefilled down
    this path for nothing.)"""
    if min_tokens <= 0 or route.tokens is None or not decode.block_size:
        return 0
    last_block = (len(route.tokens) - 1) // decode.block_size * decode.block_size
    held = min(decode.overlap_tokens(route), last_block)
    on_prefill = max((i.overlap_tokens(route) for i in prefill.instances if i.available), default=0)
    return held if held - on_prefill >= min_tokens else 0
