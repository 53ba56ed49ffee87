"""The PD parameters (`kv_transfer_params`) as types, decoded and checked once where
they enter a server.

Three messages cross HTTP (DESIGN.md, "PD protocol"):

- proxy -> P: `{"do_remote_decode": true}` (`RemoteDecodeParams`): prefill, sample the
  first token, keep the blocks for a decode server. With `"prefix": {...}`, a decode
  server's `RemotePrefillParams` for the first `num_prompt_tokens` of the prompt (KV it
  holds from an earlier turn and exported for this request): P reads what it lacks of that
  prefix from D instead of computing it, then computes the rest.
- P -> proxy -> D: `RemotePrefillParams`, where P keeps the prompt's KV blocks, the
  first token P sampled for each sequence and, when the request asks, their logprobs and
  the prompt's. D reads those blocks instead of computing the prompt, and answers those
  tokens and logprobs as its own.
- no PD: absent, null, `{}`, or both flags false.

Every field is typed and bounded (ports 1-65535, ids and counts within int32, strings of
bounded length, a finite lease), unknown fields are refused, and a malformed set raises
`TransferParamsError` naming the field, which the server answers with a 400. What can
only be checked against the serving model (the first token inside the vocabulary) is
checked by the server; what depends on the request's prompt (prompt length, block-list
shape) by the connector, which then rejects the load and tells P to free its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from pd.logprobs import Logprobs, PromptLogprobs
from wire.kv_params import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_TRANSFER_PARAMS

INT32 = 2**31
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=INT32)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=INT32)]
Count = Annotated[int, msgspec.Meta(ge=1, lt=INT32)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
WallClock = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]  # seconds since the epoch; finite
HexDigest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]  # sha256
MAX_GROUPS = 256
BlockIds = Annotated[list[Annotated[list[BlockId], msgspec.Meta(max_length=INT32)]],
                     msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
MAX_TP_SIZE = 256  # tensor-parallel ranks of a prefill server
MAX_DIGEST_BYTES = 1 << 28  # of one rank's digests of a request's blocks (pd/kv_transfer/digests.py)
Tokens = Annotated[int, msgspec.Meta(ge=0, lt=INT32)]


class PromptSources(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where a prefill server's prompt tokens came from: computed for the request, its
    prefix cache, another server's cache (a prefix read from a decode server), or an
    offload tier (pd/scheduling/prompt_sources.py)."""

    computed: Tokens = 0
    local_cache: Tokens = 0
    remote: Tokens = 0
    host: Tokens = 0
    disk: Tokens = 0

    @classmethod
    def of(cls, counts: dict[str, int]) -> PromptSources:
        return cls(**counts)

    def counts(self) -> dict[str, int]:
        """The sources as a dict: computed and local_cache always, the others where not 0."""
        out = msgspec.structs.asdict(self)
        return {k: v for k, v in out.items() if v or k in ("computed", "local_cache")}
MAX_SEQUENCES = 1024  # first tokens a set may carry (the server holds them to the request's n)


# Inside the engine (server -> engine process -> scheduler -> connector) the two kinds are
# one tagged union, `TransferParams`; the tag is not part of the JSON a client sees.
KIND = "kind"


class TransferParamsError(ValueError):
    """`kv_transfer_params` that are not a valid PD parameter set; `field` names the
    offending field (dotted, under `kv_transfer_params`)."""

    def __init__(self, message: str, field: str = KV_TRANSFER_PARAMS) -> None:
        super().__init__(message)
        self.field = field


class RemotePrefillParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field=KIND, tag="prefill"):
    """P -> D: the request's KV blocks are held on P (engine `remote_engine_id`, side
    channel `remote_host:remote_port`) under P's request id, positional per KV cache
    group (0: P holds no block there); P sampled `first_token_ids`, one per sequence of
    the request (n), scored in `first_logprobs` when it asks for logprobs; with echo and
    logprobs P scored the prompt, `prompt_logprobs`. P's lease word `lease_slot` holds
    `lease_token` while P holds the blocks (connectors/nixl/leases.py): D checks it after
    its read. With a deployment secret P signs them (`signature`), and D acts only on
    signed ones; see signing.py."""

    do_remote_prefill: Literal[True]
    remote_engine_id: Name
    remote_host: Host
    remote_port: Port
    remote_request_id: Name
    remote_block_ids: BlockIds
    num_prompt_tokens: Count
    first_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_SEQUENCES)]
    block_size: Count
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)] = 1  # P's ranks, each holding some heads
    lease_expires_at: WallClock | None = None  # a read ending later is a failure
    lease_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] | None = None  # what a KeepAlive extends by
    prompt_digest: HexDigest | None = None  # of the prompt P prefilled (pd/kv_transfer/signing.py)
    lease_slot: Annotated[int, msgspec.Meta(ge=0, lt=INT32)] | None = None  # P's lease word for the blocks
    lease_token: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] | None = None  # it holds while they are held
    signature: HexDigest | None = None  # HMAC over every other field, with the deployment's secret
    first_logprobs: Logprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_sources: PromptSources | None = None  # where P's prompt tokens came from (computed, its cache, ...)
    # per P rank, its digests of the blocks (pd/kv_transfer/digests.py; None: P made none)
    kv_digests: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)]],
                          msgspec.Meta(min_length=1, max_length=MAX_TP_SIZE)] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object a response carries (the flag says what it is; no `kind`)."""
        fields = msgspec.to_builtins(self)
        del fields[KIND]
        return fields

    def check_request(self, prompt_token_ids: Sequence[int], n: int, logprobs: int | None,
                      prompt_logprobs: int | None, vocab_size: int) -> None:
        """TransferParamsError unless these parameters fit the request they come with and
        the model: a first token per sequence, the logprobs it asks for (k alternatives),
        scoring those tokens and the prompt's, and every token id in the vocabulary."""
        if len(self.first_token_ids) != n:
            raise TransferParamsError(f"kv_transfer_params.first_token_ids has {len(self.first_token_ids)} tokens "
                                      f"for a request of n={n} sequences", "kv_transfer_params.first_token_ids")
        _check_rows("first_logprobs", self.first_logprobs, self.first_token_ids, logprobs)
        scored = None if self.prompt_logprobs is None else self.prompt_logprobs
        if scored is not None and scored.start != 1:
            raise TransferParamsError("kv_transfer_params.prompt_logprobs must start at token 1",
                                      "kv_transfer_params.prompt_logprobs")
        _check_rows("prompt_logprobs", scored, list(prompt_token_ids[1:]), prompt_logprobs)
        for name, rows in (("first_token_ids", [self.first_token_ids]),
                           ("first_logprobs", self.first_logprobs.token_ids if self.first_logprobs else []),
                           ("prompt_logprobs", scored.token_ids if scored else [])):
            bad = [t for ids in rows for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise TransferParamsError(f"kv_transfer_params.{name} holds token ids outside the vocabulary "
                                          f"[0, {vocab_size}): {bad[:5]}", f"kv_transfer_params.{name}")


class RemoteDecodeParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field=KIND, tag="decode"):
    """proxy -> P: prefill this request and keep its blocks for a decode server; with
    `prefix`, read the prompt's first `prefix.num_prompt_tokens` tokens' KV from where
    those parameters say (a decode server) rather than compute them."""

    do_remote_decode: Literal[True]
    prefix: RemotePrefillParams | None = None

    def check_prefix(self, prompt_token_ids: Sequence[int]) -> None:
        """TransferParamsError unless the prefix leaves at least one prompt token to compute."""
        if self.prefix is not None and self.prefix.num_prompt_tokens >= len(prompt_token_ids):
            raise TransferParamsError(f"kv_transfer_params.prefix covers {self.prefix.num_prompt_tokens} tokens of a "
                                      f"prompt of {len(prompt_token_ids)}: it must leave one to compute",
                                      "kv_transfer_params.prefix.num_prompt_tokens")


def _check_rows(name: str, rows: Logprobs | None, token_ids: list[int], k: int | None) -> None:
    """Rows scoring exactly `token_ids` with k alternatives each, or none when k is None."""
    field = f"kv_transfer_params.{name}"
    if (rows is None) != (k is None):
        raise TransferParamsError(f"{field} must be {'absent' if k is None else 'present'} for this request", field)
    if rows is None:
        return
    if [ids[0] for ids in rows.token_ids] != token_ids:
        raise TransferParamsError(f"{field} does not score this request's tokens", field)
    if any(len(ids) != 1 + k for ids in rows.token_ids):
        raise TransferParamsError(f"{field} rows must hold the token and {k} alternatives", field)


class _NoPD(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    do_remote_decode: Literal[False] = False
    do_remote_prefill: Literal[False] = False


TransferParams = RemoteDecodeParams | RemotePrefillParams  # tagged by `kind`


def parse_transfer_params(raw: Any) -> TransferParams | None:
    """The typed parameters of a request body's `kv_transfer_params` (None: no PD);
    TransferParamsError naming the first bad field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TransferParamsError("kv_transfer_params must be an object")
    if raw.get(DO_REMOTE_PREFILL) is True:
        kind: type = RemotePrefillParams
    elif raw.get(DO_REMOTE_DECODE) is True:
        kind = RemoteDecodeParams
    else:
        kind = _NoPD
    try:
        params = msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise _named(exc) from None
    return None if isinstance(params, _NoPD) else params


def _named(exc: msgspec.ValidationError) -> TransferParamsError:
    """msgspec says "... - at `$.remote_port`", "... unknown field `x`" or "... missing
    required field `x`"; name the field."""
    message = str(exc)
    path = ""
    if "at `$" in message:
        path = message.rpartition("at `$")[2].rstrip("`").split("[")[0]
    elif message.endswith("`") and " field `" in message:
        path = "." + message.rpartition(" field `")[2].rstrip("`")
    field = KV_TRANSFER_PARAMS + path
    return TransferParamsError(f"{field}: {message.partition(' - at ')[0]}", field)
