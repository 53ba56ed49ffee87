"""`pd proxy` in front of real prefill and decode servers (NIXL between them), against
one colocated server: the official `openai` client through the proxy, bad requests,
disconnects, and a prefill server dying mid-run."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from launch import http_client
from tests.support.malformed import BAD_REQUESTS
from tests.support.server_harness import free_port, running_proxy, running_server, stop_process

pytestmark = pytest.mark.slow
MODEL = "qwen3"
PROMPT = "A lighthouse keeper wrote down every ship that passed the rocks. " * 3
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def deployment(tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp("proxy")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models[MODEL]
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(model, logs / f"{name}.log", *args))
        servers = {"p1": start("p1", "--role", "prefill"), "p2": start("p2", "--role", "prefill"),
                   "d": start("d", "--role", "decode"), "c": colocated[MODEL]}
        proxy = stack.enter_context(running_proxy(
            logs / "proxy.log", "--prefill", servers["p1"].url, servers["p2"].url,
            "--decode", servers["d"].url, "--probe-interval", "0.5"))
        yield servers | {"proxy": proxy}


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_the_proxy_equal_a_colocated_server(deployment, stream) -> None:
    reference = client_of(deployment["c"]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                               temperature=0)
    out = client_of(deployment["proxy"]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                             temperature=0, stream=stream)
    text = "".join(chunk.choices[0].text for chunk in out if chunk.choices) if stream else out.choices[0].text
    assert text == reference.choices[0].text
    if not stream:
        assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == reference.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_proxy_equals_a_colocated_server(deployment, stream) -> None:
    reference = client_of(deployment["c"]).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                                    temperature=0)
    out = client_of(deployment["proxy"]).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0, stream=stream)
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)
    else:
        text = out.choices[0].message.content
    assert text == reference.choices[0].message.content


def test_models_health_and_request_id(deployment) -> None:
    proxy = deployment["proxy"]
    assert [m.id for m in client_of(proxy).models.list().data] == [MODEL]
    health = proxy.health().json()
    assert health["status"] == "ok" and [i["role"] for i in health["prefill"] + health["decode"]] == [
        "prefill", "prefill", "decode"]
    response = http_client().post(f"{proxy.url}/v1/completions", headers={"X-Request-Id": "proxy-test-1"},
                                  json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "proxy-test-1"
    assert response.json()["id"] == "proxy-test-1"  # what D answered under: the same id


def test_a_bad_request_gets_the_servers_4xx_and_the_proxy_keeps_serving(deployment) -> None:
    proxy = deployment["proxy"]
    response = http_client().post(f"{proxy.url}/v1/completions", json={"prompt": "Hi", "temperature": 7}, timeout=60)
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]
    response = http_client().post(f"{proxy.url}/v1/completions", content=b"{not json", timeout=60)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert all(i["healthy"] for i in proxy.health().json()["prefill"])
    assert http_client().post(f"{proxy.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                              timeout=60).status_code == 200


@pytest.fixture(scope="module")
def engine_pids(deployment) -> dict[str, int]:
    return {name: deployment[name].health().json()["engine_pid"] for name in ("p1", "p2", "d")}


# The proxy sets kv_transfer_params itself (P's request and D's): a client's are replaced.
THROUGH_THE_PROXY = [name for name in BAD_REQUESTS if not name.startswith("kv_transfer_params")]


@pytest.mark.parametrize("name", THROUGH_THE_PROXY)
def test_every_malformed_request_through_the_proxy_is_a_4xx_and_nothing_is_held(deployment, engine_pids,
                                                                               name) -> None:
    path, body, headers = BAD_REQUESTS[name]
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http_client().post(f"{deployment['proxy'].url}{path}", timeout=60,
                                  headers={"Content-Type": "application/json"} | headers, **kwargs)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    health = deployment["proxy"].health().json()
    assert all(i["healthy"] for i in health["prefill"] + health["decode"]), health
    for server in ("p1", "p2", "d"):
        assert deployment[server].health().json()["engine_pid"] == engine_pids[server]
        # P's blocks held for a D that refused the request are released through P's engine: a step later
        assert deployment[server].wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0, server


def test_a_client_that_disconnects_frees_the_decode_servers_blocks(deployment) -> None:
    proxy, d = deployment["proxy"], deployment["d"]
    generated = d.metrics()["pd_generation_tokens_total"]
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with http_client().stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    assert d.wait_for_metric("pd_num_requests_running", lambda v: v == 0) == 0
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    assert d.metrics()["pd_generation_tokens_total"] - generated < 3000  # stopped early: aborted on D


def test_with_no_prefill_server_reachable_the_proxy_answers_503(deployment, tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with running_proxy(tmp_path / "proxy.log", "--prefill", dead, "--decode", deployment["d"].url) as proxy:
        response = http_client().post(f"{proxy.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert response.status_code == 503, response.text
        assert "no healthy prefill instance" in response.json()["error"]["message"]
        assert proxy.health().status_code == 503


def test_killing_one_prefill_server_mid_run_the_rest_complete_through_the_other(deployment) -> None:
    """Last in the module: it stops p2."""
    proxy, p2 = deployment["proxy"], deployment["p2"]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    expected = http_client().post(f"{deployment['c'].url}/v1/completions", json=body,
                                  timeout=60).json()["choices"][0]["text"]

    def send(i: int) -> str:
        response = http_client().post(f"{proxy.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(send, i) for i in range(8)]
        assert first[0].result() == expected
        stop_process(p2.process)
        rest = [pool.submit(send, i) for i in range(16)]
        texts = [f.result() for f in first + rest]
    assert texts == [expected] * len(texts)
    state = {i["url"]: i for i in proxy.health().json()["prefill"]}
    assert not state[p2.url]["healthy"] and state[deployment["p1"].url]["healthy"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_echo_and_n_through_the_proxy_equal_a_colocated_server(deployment, stream) -> None:
    """The openai client's fields: P's first tokens and their logprobs (and the prompt's,
    echoed) travel in P's kv_transfer_params to D, which answers them as its own."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=5, n=3, logprobs=2, echo=True)
    reference = client_of(deployment["c"]).completions.create(**kw)
    out = client_of(deployment["proxy"]).completions.create(**kw, stream=stream)
    got: dict[int, list] = {}
    for chunk in out if stream else [out]:
        for choice in chunk.choices:
            text, logprobs = got.setdefault(choice.index, ["", []])
            got[choice.index] = [text + choice.text, logprobs + choice.logprobs.token_logprobs]
    assert sorted(got) == [0, 1, 2]
    for choice in reference.choices:
        text, logprobs = got[choice.index]
        assert text == choice.text and text.startswith(PROMPT)
        assert logprobs[0] is None and len(logprobs) == len(choice.logprobs.token_logprobs)
        assert all(abs(a - b) <= 1e-5 for a, b in zip(logprobs[1:], choice.logprobs.token_logprobs[1:]))
