"""A minimal client-side P-then-D driver for the PD server tests (the proxy's job, done
by hand): the request goes to P as the proxy sends it (`prefill_body`: stream=false and
kv_transfer_params={"do_remote_decode": true}; P stops after the first token), then to D
with P's kv_transfer_params."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.upstream import prefill_body

TIMEOUT_S = 120


@dataclass
class Answer:
    """What one request produced: output token ids, text and the finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    body: dict[str, Any]  # the whole response (non-streamed) or the last chunk (streamed)


def complete(server, body: dict[str, Any], endpoint: str = "completions") -> Answer:
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body | {"return_token_ids": True}, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    out = response.json()
    choice = out["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return Answer(choice["token_ids"], text, choice["finish_reason"], out)


def stream(server, body: dict[str, Any], endpoint: str = "completions") -> Answer:
    token_ids, text, finish_reason, last = [], "", None, {}
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=body | {"stream": True, "return_token_ids": True},
                      timeout=TIMEOUT_S) as response:
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
    assert params["first_token_id"] == answer.token_ids[0]
    return answer


def p_then_d(p, d, body: dict[str, Any], streamed: bool = False, endpoint: str = "completions") -> Answer:
    params = prefill(p, body, endpoint).body["kv_transfer_params"]
    send = stream if streamed else complete
    return send(d, body | {"kv_transfer_params": params}, endpoint)
