"""The client's request body: read up to a size limit, then parsed as strict JSON.

Python's `json.loads` accepts more than JSON: NaN / Infinity literals, numbers that
overflow to inf (1e309), escapes that decode to lone surrogates ("\\ud800"), and nesting
as deep as the interpreter's stack. Such a body cannot be encoded again for the servers
(the encoder refuses NaN, UTF-8 refuses a lone surrogate), so `parse_body` refuses it
here with a 400 naming what and where, and what it returns always re-encodes. Integers
of any size pass (the servers validate ranges), up to the interpreter's limit on the
digits of an integer (4300), which is a 400 too.

Then what the proxy makes of it for the servers: P's body (`prefill_body`), a decode
server's export of a prefix for P to read (`export_body`), and a completion's prompt
when it is given as token ids (`token_id_prompt`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from proxy.errors import ProxyError
from wire.kv_params import DO_REMOTE_DECODE, KV_TRANSFER_PARAMS, PREFIX

MAX_DEPTH = 64  # nested objects and arrays; the body itself is depth 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = (int, float, bool, type(None))  # what json.loads makes besides str, dict and list


class BodyError(ProxyError):
    """A request body the proxy refuses; `path` is where in the body, outermost first."""

    def __init__(self, message: str, code: str, status: int = 400) -> None:
        super().__init__(message, code, status)
        self.path: list[str | int] = []

    def located(self) -> BodyError:
        if self.path:
            # a key may itself hold the lone surrogate: escape it, or this error would not encode
            self.param = ".".join(str(part) for part in self.path).encode("utf-8", "backslashreplace").decode()
            self.message = f"{self.message} (at {self.param})"
        return self


def parse_body(raw: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The body as a JSON object that re-encodes as strict JSON; BodyError otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the body is not valid UTF-8 (byte {exc.start})", "invalid_utf8") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except json.JSONDecodeError as exc:
        raise BodyError(f"the body is not valid JSON: {exc}", "invalid_json") from None
    except ValueError as exc:  # an integer with more digits than int() converts
        raise BodyError(f"a number in the body is too large: {exc}", "number_too_large") from None
    if not isinstance(body, dict):
        raise BodyError(f"the body must be a JSON object, not {_json_type(body)}", "invalid_body")
    try:
        _check(body, 1, max_depth)
    except BodyError as exc:
        raise exc.located() from None
    return body


def _refuse_constant(name: str) -> float:
    raise BodyError(f"{name} is not a JSON number", "non_finite_number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"the number {text[:40]} overflows a double", "non_finite_number")
    return value


def _too_deep(max_depth: int) -> BodyError:
    return BodyError(f"the body nests objects and arrays deeper than {max_depth}", "nesting_too_deep")


def _check(value: dict | list, depth: int, max_depth: int) -> None:
    """Depth of containers and lone surrogates in strings and keys, in and below `value`
    (at `depth`); recursion stops past `max_depth`, and an error's path is built only
    on its way out."""
    if depth > max_depth:
        raise _too_deep(max_depth)
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        if type(item) in _SCALARS and type(key) is int:  # the bulk of a token-id prompt
            continue
        try:
            if type(key) is str and _has_surrogate(key):
                raise BodyError("a key holds a lone UTF-16 surrogate", "lone_surrogate")
            if type(item) is str and _has_surrogate(item):
                raise BodyError("a string holds a lone UTF-16 surrogate", "lone_surrogate")
            if type(item) in (dict, list):
                _check(item, depth + 1, max_depth)
        except BodyError as exc:
            exc.path.insert(0, key)
            raise


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}[type(value)]


def prefill_body(body: dict[str, Any], prefix: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body P gets: the client's, unstreamed, asking P to keep the blocks for D. P
    validates it exactly as D will (so a request D would refuse is refused before any
    prefill) and itself stops after the first token of a do_remote_decode request, so
    max_tokens, min_tokens, stream_options and the rest are sent as they are. `prefix`:
    a decode server's parameters for a prefix of the prompt it exported, for P to read."""
    params: dict[str, Any] = {DO_REMOTE_DECODE: True} | ({PREFIX: prefix} if prefix is not None else {})
    return body | {"stream": False, KV_TRANSFER_PARAMS: params}


def export_body(body: dict[str, Any], prefix_ids: list[int]) -> dict[str, Any]:
    """The body that has a decode server export the KV of `prefix_ids` (the first tokens of
    the client's prompt, which it holds from an earlier turn) for a prefill server to read:
    a one-token completion of them kept for a reader, under the client's model and
    cache_salt (the salt is part of the blocks' names)."""
    export = {key: body[key] for key in ("model", "cache_salt") if key in body}
    return export | {"prompt": prefix_ids, "max_tokens": 1, "temperature": 0, "stream": False,
                     KV_TRANSFER_PARAMS: {DO_REMOTE_DECODE: True}}


def token_id_prompt(body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids (a list of ints, or a batch of one), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None
