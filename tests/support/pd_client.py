"""A minimal client-side P-then-D driver for the PD server tests (the proxy's job, done
by hand): the request goes to P as the proxy sends it (`prefill_body`: stream=false and
kv_transfer_params={"do_remote_decode": true}; P stops after the first token), then to D
with P's kv_transfer_params."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from launch import http_client
from proxy.body import prefill_body

TIMEOUT_S = 120


@dataclass
class Answer:
    """What one request produced: output token ids, text and the finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    body: dict[str, Any]  # the whole response (non-streamed) or the last chunk (streamed)


def complete(server, body: dict[str, Any], endpoint: str = "completions") -> Answer:
    response = http_client().post(f"{server.url}/v1/{endpoint}", json=body | {"return_token_ids": True},
                                  timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    out = response.json()
    choice = out["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return Answer(choice["token_ids"], text, choice["finish_reason"], out)


def stream(server, body: dict[str, Any], endpoint: str = "completions") -> Answer:
    token_ids, text, finish_reason, last = [], "", None, {}
    with http_client().stream("POST", f"{server.url}/v1/{endpoint}",
                              json=body | {"stream": True, "return_token_ids": True}, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line[6:])
            assert "error" not in last, last
            choice = last["choices"][0]
            token_ids += choice["token_ids"]
            text += choice.get("text", choice.get("delta", {}).get("content", ""))
            finish_reason = choice["finish_reason"] or finish_reason
    return Answer(token_ids, text, finish_reason, last)


def prefill(p, body: dict[str, Any], endpoint: str = "completions") -> Answer:
    """P's answer: its first token and the kv_transfer_params D needs."""
    answer = complete(p, prefill_body(body), endpoint)
    params = answer.body["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["num_prompt_tokens"] == answer.body["usage"]["prompt_tokens"]
    assert answer.token_ids[0] in params["first_token_ids"]  # (with best_of, P answers its best first)
    return answer


def p_then_d(p, d, body: dict[str, Any], streamed: bool = False, endpoint: str = "completions") -> Answer:
    params = prefill(p, body, endpoint).body["kv_transfer_params"]
    send = stream if streamed else complete
    return send(d, body | {"kv_transfer_params": params}, endpoint)


def choices(server, body: dict[str, Any], endpoint: str = "completions", streamed: bool = False) -> list[dict]:
    """The answer's choices, by index; streamed, each choice's chunks merged into the
    shape of an unstreamed choice (texts and token ids joined, logprobs lists joined)."""
    if not streamed:
        response = http_client().post(f"{server.url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()["choices"]
    merged: dict[int, dict] = {}
    with http_client().stream("POST", f"{server.url}/v1/{endpoint}", json=body | {"stream": True},
                              timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    _merge(merged.setdefault(choice["index"], {}), choice)
    return [merged[i] for i in sorted(merged)]


def _merge(into: dict, chunk: dict) -> None:
    if "delta" in chunk:  # chat: the delta's content joins the message's
        content = chunk["delta"].get("content") or ""
        into.setdefault("message", {"role": "assistant", "content": ""})["content"] += content
    for key, value in chunk.items():
        if key in ("delta",):
            continue
        if key == "text" or key == "token_ids":
            into[key] = into.get(key, type(value)()) + value
        elif key == "logprobs" and value is not None:
            if into.get("logprobs") is None:
                into["logprobs"] = {name: [] for name in value}
            held = into["logprobs"]
            for name, items in value.items():
                held[name] += items
        elif key == "finish_reason":
            into[key] = value or into.get(key)
        elif key not in into:
            into[key] = value


def assert_choices_close(got: list[dict], expected: list[dict], atol: float = 1e-5) -> None:
    """The same choices: equal texts, token ids and token strings, logprobs within atol."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (a["index"], a.get("text"), a.get("message"), a.get("token_ids"), a["finish_reason"]) == (
            b["index"], b.get("text"), b.get("message"), b.get("token_ids"), b["finish_reason"])
        _assert_close(a.get("logprobs"), b.get("logprobs"), atol)


def _assert_close(a: Any, b: Any, atol: float) -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= atol, (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (a, b)
        for key in a:
            _assert_close(a[key], b[key], atol)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _assert_close(x, y, atol)
    else:
        assert a == b


def p_then_d_choices(p, d, body: dict[str, Any], streamed: bool = False, endpoint: str = "completions") -> list[dict]:
    """D's choices for a request P prefilled (see `choices`)."""
    params = prefill(p, body, endpoint).body["kv_transfer_params"]
    return choices(d, body | {"kv_transfer_params": params}, endpoint, streamed)
