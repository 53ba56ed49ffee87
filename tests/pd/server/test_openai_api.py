"""The official `openai` client against a real `pd serve`, one server per architecture:
completions and chat, streamed and not, equal `pd.LLM` token for token (greedy), and
sampling fields (seed, top_k, top_p, stop, ignore_eos) reach the engine."""

from __future__ import annotations

import json

import openai
import pytest

from launch import http_client
from pd.contracts.sampling_params import SamplingParams
from pd.engine.core import group_names
from pd.llm import LLM
from pd.server.chat import ChatTemplate
from pd.tokenizer import Tokenizer
from tests.support.server_harness import ARCHS, running_server

pytestmark = pytest.mark.slow

KV_CACHE_MEMORY = 32 << 20
MAX_TOKENS = 24
PROMPT = "The quick brown fox"
TOKEN_PROMPT = [17, 400, 1234, 99, 3000, 7, 2048, 512, 42]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(arch, tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"serve-{arch}") / "server.log"
    with running_server(tiny_models[arch], log, "--kv-cache-memory", str(KV_CACHE_MEMORY)) as server:
        yield server


@pytest.fixture(scope="module")
def llm(arch, tiny_models) -> LLM:
    return LLM(str(tiny_models[arch]), kv_cache_memory=KV_CACHE_MEMORY)


@pytest.fixture(scope="module")
def greedy(llm):
    """`greedy(prompt, **params)`: LLM's greedy output, computed once per prompt and params."""
    cache = {}

    def run(prompt, max_tokens: int = MAX_TOKENS, **params):
        key = (tuple(prompt) if isinstance(prompt, list) else prompt, max_tokens, tuple(sorted(params.items())))
        if key not in cache:
            cache[key] = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **params))[0]
        return cache[key]

    return run


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_prompt_ids(model_dir) -> list[int]:
    tokenizer = Tokenizer(model_dir)
    return ChatTemplate.from_model_dir(model_dir, tokenizer.config).encode(tokenizer, MESSAGES)


def test_models_lists_the_directory_name(client, arch) -> None:
    assert [m.id for m in client.models.list().data] == [arch]


@pytest.mark.parametrize("prompt", [PROMPT, TOKEN_PROMPT], ids=["text", "token_ids"])
def test_completion_equals_llm(client, greedy, arch, prompt, server) -> None:
    expected = greedy(prompt)
    out = client.completions.create(model=arch, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected.text, server.log_tail()
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("prompt", [PROMPT, [TOKEN_PROMPT]], ids=["text", "one_token_list"])
def test_streamed_completion_equals_llm(client, greedy, arch, prompt) -> None:
    expected = greedy(prompt[0] if isinstance(prompt, list) else prompt)
    chunks = list(client.completions.create(model=arch, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_return_token_ids_gives_the_llm_token_ids(server, greedy, arch, tiny_models, endpoint) -> None:
    prompt = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    expected = greedy(PROMPT if endpoint == "completions" else chat_prompt_ids(tiny_models[arch]))
    body = prompt | {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    out = http_client().post(f"{server.url}/v1/{endpoint}", json=body, timeout=60).json()
    assert out["choices"][0]["token_ids"] == expected.token_ids
    assert out["choices"][0]["prompt_token_ids"] == expected.prompt_token_ids
    streamed = []
    with http_client().stream("POST", f"{server.url}/v1/{endpoint}", json=body | {"stream": True},
                              timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0].get("token_ids", [])
    assert streamed == expected.token_ids
    assert "token_ids" not in http_client().post(f"{server.url}/v1/{endpoint}", json=prompt | {"max_tokens": 2},
                                                 timeout=60).json()["choices"][0]


def test_chat_equals_llm_on_the_rendered_template(client, greedy, arch, tiny_models) -> None:
    expected = greedy(chat_prompt_ids(tiny_models[arch]))
    out = client.chat.completions.create(model=arch, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")


def test_streamed_chat_equals_llm(client, greedy, arch, tiny_models) -> None:
    expected = greedy(chat_prompt_ids(tiny_models[arch]))
    chunks = list(client.chat.completions.create(model=arch, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_and_finishes_with_stop(client, greedy, arch, server, stream) -> None:
    expected = greedy(PROMPT, ignore_eos=True).text
    stop = expected[7:10]
    assert stop, expected
    kwargs = {"model": arch, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
              "stop": [stop, "\x00never"], "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs)
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert text == expected[:expected.index(stop)]
    assert reason == "stop"
    # Stopped early by the server: the engine request was aborted and its blocks freed.
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    assert server.metrics()["pd_num_requests_running"] == 0


def test_seeded_sampling_equals_llm(client, llm, arch) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    expected = llm.generate([PROMPT], params)[0]
    out = client.completions.create(model=arch, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9,
                                    seed=1234, extra_body={"top_k": 50, "ignore_eos": True})
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == MAX_TOKENS and out.choices[0].finish_reason == "length"


def test_stop_token_ids_finish_the_request(client, greedy, arch) -> None:
    expected = greedy(TOKEN_PROMPT, ignore_eos=True)
    stop_id = expected.token_ids[3]
    first = expected.token_ids.index(stop_id)
    out = client.completions.create(model=arch, prompt=TOKEN_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    assert out.usage.completion_tokens == first + 1 and out.choices[0].finish_reason == "stop"


def test_default_max_tokens_is_the_remaining_context(server, arch) -> None:
    # max_model_len - prompt would take long; a stop token id (any first token) ends it
    # at once, so only acceptance (no 400 for a missing max_tokens) is checked.
    body = {"model": arch, "prompt": TOKEN_PROMPT, "temperature": 0,
            "stop_token_ids": list(range(4096))}
    response = http_client().post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_request_id_header_and_kv_transfer_params_round_trip(server, arch) -> None:
    body = {"model": arch, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": False}}
    response = http_client().post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": f"req-{arch}-1"},
                                  timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == f"req-{arch}-1"
    data = response.json()
    assert data["id"] == f"req-{arch}-1"
    assert "kv_transfer_params" in data and data["kv_transfer_params"] is None  # the null connector's answer


def test_chat_template_refusal_is_a_400(server, arch) -> None:
    body = {"model": arch, "max_tokens": 1,
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    response = http_client().post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    if arch == "gemma3":  # the only template here that insists on alternating roles
        assert response.status_code == 400
        assert "alternate" in response.json()["error"]["message"]
    else:
        assert response.status_code == 200, response.text


METRIC_NAMES = ["pd_num_requests_running", "pd_num_requests_waiting", "pd_kv_cache_usage",
                "pd_prefix_cache_queries_total", "pd_prefix_cache_hits_total", "pd_num_preemptions_total",
                "pd_time_to_first_token_seconds_count", "pd_inter_token_latency_seconds_count",
                "pd_e2e_request_latency_seconds_count", "pd_prompt_tokens_total", "pd_generation_tokens_total",
                'pd_request_success_total{finish_reason="length"}', "pd_engine_steps_total",
                'pd_engine_step_seconds_total{part="execute"}', 'pd_engine_step_seconds_total{part="ipc"}']


def test_engine_step_time_reaches_metrics(client, arch, server) -> None:
    """Each request's steps add to pd_engine_steps_total and to the busy time by part."""
    parts = [f'pd_engine_step_seconds_total{{part="{p}"}}' for p in ("schedule", "execute", "update", "ipc")]
    before = server.metrics()
    client.completions.create(model=arch, prompt=[11, 12, 13], max_tokens=8)
    after = server.metrics()
    assert after["pd_engine_steps_total"] - before.get("pd_engine_steps_total", 0) >= 8
    spent = {p: after[p] - before.get(p, 0.0) for p in parts}
    assert all(v >= 0 for v in spent.values()) and spent[parts[1]] > 0


def test_prefix_cache_hits_reach_usage_and_metrics(client, arch, server, llm) -> None:
    prompt = [(i * 37) % 4000 + 10 for i in range(300)]  # over two blocks even for the hybrids (144)
    before = server.metrics()
    client.completions.create(model=arch, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=arch, prompt=prompt, max_tokens=1)
    after = server.metrics()
    assert again.usage.prompt_tokens_details.cached_tokens >= 144
    assert after["pd_prefix_cache_hits_total"] - before["pd_prefix_cache_hits_total"] >= 144
    assert after["pd_prefix_cache_queries_total"] - before["pd_prefix_cache_queries_total"] >= 600
    for name in group_names(llm.engine.kv_cache_config):  # one labelled series per KV cache group
        for metric in ("pd_prefix_cache_queries_total", "pd_prefix_cache_hits_total"):
            assert f'{metric}{{group="{name}"}}' in after
    assert set(METRIC_NAMES) <= set(after)
    assert after["pd_num_requests_running"] == 0 and 0 <= after["pd_kv_cache_usage"] < 1
