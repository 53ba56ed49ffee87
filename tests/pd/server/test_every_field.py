"""Every field of the request schemas is applied or refused, never accepted and ignored.

`CHECKS` has one entry per declared field of `CompletionRequest` and `ChatCompletionRequest`
(a field added without one fails `test_every_declared_field_has_a_check`). Each check sends
requests to a live server (tiny Qwen3 with a KV connector, so the PD parameters apply) and
asserts that the field changed the answer the way it says, or that the server refused it
with a 400. Unknown fields are refused (test_protocol.py); the few bookkeeping fields that
cannot change an answer are listed as such.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import pytest

from launch import http_client
from pd.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.support.pd_client import TIMEOUT_S

PROMPT = "The keeper of the lighthouse counted ships"
MESSAGES = [{"role": "user", "content": PROMPT}]
SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 8, "ignore_eos": True}
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
BOOKKEEPING = IGNORED_FIELDS | {"user"}  # cannot change an answer (OpenAI's end-user id, metadata, ...)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from tests.support.server_harness import running_server

    with running_server(tiny_models["qwen3"], tmp_path_factory.mktemp("fields") / "s.log",
                        "--kv-connector", "nixl") as s:
        yield s


class Client:
    def __init__(self, server, endpoint: str) -> None:
        self.server, self.endpoint = server, endpoint
        self.chat = endpoint == "chat/completions"

    def post(self, **fields) -> httpx.Response:
        base = {"messages": MESSAGES} if self.chat else {"prompt": PROMPT}
        return http_client().post(f"{self.server.url}/v1/{self.endpoint}",
                                  json=base | {"return_token_ids": True} | fields, timeout=TIMEOUT_S)

    def answer(self, **fields) -> dict:
        response = self.post(**fields)
        assert response.status_code == 200, response.text
        return response.json()

    def tokens(self, **fields) -> list[int]:
        return self.answer(**fields)["choices"][0]["token_ids"]

    def text(self, **fields) -> str:
        choice = self.answer(**fields)["choices"][0]
        return choice["message"]["content"] if self.chat else choice["text"]

    def refused(self, **fields) -> bool:
        response = self.post(**fields)
        return response.status_code == 400 and response.json()["error"]["param"] is not None


def token_id(server, text: str) -> int:
    answer = Client(server, "completions").answer(prompt=text, max_tokens=1)
    return answer["choices"][0]["prompt_token_ids"][-1]


# ---- the checks: each asserts that its field was applied, or refused ----------------


def model(c: Client) -> None:
    assert c.post(model="another-model").status_code == 404
    served = http_client().get(f"{c.server.url}/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    assert c.tokens(model=served, **GREEDY) == c.tokens(**GREEDY)


def max_tokens(c: Client) -> None:
    assert c.answer(max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3


def temperature(c: Client) -> None:
    assert c.tokens(**SAMPLED) != c.tokens(**SAMPLED | {"temperature": 0}) == c.tokens(**GREEDY)


def top_p(c: Client) -> None:
    assert c.tokens(**SAMPLED | {"top_p": 1e-6}) == c.tokens(**GREEDY) != c.tokens(**SAMPLED)


def top_k(c: Client) -> None:
    assert c.tokens(**SAMPLED | {"top_k": 1}) == c.tokens(**GREEDY) != c.tokens(**SAMPLED)


def min_p(c: Client) -> None:
    assert c.tokens(**SAMPLED | {"min_p": 1.0}) == c.tokens(**GREEDY) != c.tokens(**SAMPLED)


def seed(c: Client) -> None:
    assert c.tokens(**SAMPLED) == c.tokens(**SAMPLED) != c.tokens(**SAMPLED | {"seed": 6})


def stop(c: Client) -> None:
    text = c.text(**GREEDY)
    cut = c.answer(**GREEDY, stop=[text[3:5]])["choices"][0]
    assert cut["finish_reason"] == "stop" and len(cut["token_ids"]) < 8


def stop_token_ids(c: Client) -> None:
    tokens = c.tokens(**GREEDY)
    stopped = c.tokens(**GREEDY | {"stop_token_ids": [tokens[2]]})
    assert stopped == tokens[:tokens.index(tokens[2]) + 1]


def ignore_eos(c: Client) -> None:
    eos = token_id(c.server, "<|im_end|>")
    forced = {"temperature": 0, "max_tokens": 5, "logit_bias": {str(eos): 100}}
    assert c.tokens(**forced) == [eos] and c.tokens(**forced, ignore_eos=True) == [eos] * 5


def min_tokens(c: Client) -> None:
    eos = token_id(c.server, "<|im_end|>")
    held = c.tokens(temperature=0, max_tokens=6, logit_bias={str(eos): 100}, min_tokens=3)
    assert len(held) == 4 and eos not in held[:3] and held[3] == eos


def n(c: Client) -> None:
    assert [choice["index"] for choice in c.answer(**SAMPLED, n=3)["choices"]] == [0, 1, 2]


def best_of(c: Client) -> None:
    every = c.answer(**SAMPLED, n=4, logprobs=0) if not c.chat else c.answer(**SAMPLED, n=4, logprobs=True)
    best = c.answer(**SAMPLED, n=1, best_of=4)["choices"]
    score = (lambda ch: sum(ch["logprobs"]["token_logprobs"])) if not c.chat else (
        lambda ch: sum(t["logprob"] for t in ch["logprobs"]["content"]))
    assert best[0]["token_ids"] == max(every["choices"], key=score)["token_ids"]


def stream(c: Client) -> None:
    response = c.post(**GREEDY, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream") and "data: [DONE]" in response.text


def stream_options(c: Client) -> None:
    response = c.post(**GREEDY, stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all("usage" not in chunk for chunk in chunks[:-1])
    response = c.post(**GREEDY, stream=True, stream_options={"continuous_usage_stats": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert [chunk["usage"]["completion_tokens"] for chunk in chunks][-1] == 8


def user(c: Client) -> None:
    assert c.tokens(**GREEDY, user="alice") == c.tokens(**GREEDY)  # bookkeeping


def kv_transfer_params(c: Client) -> None:
    answer = c.answer(**GREEDY, kv_transfer_params={"do_remote_decode": True})
    assert answer["usage"]["completion_tokens"] == 1 and answer["kv_transfer_params"]["do_remote_prefill"]
    held = answer["kv_transfer_params"]
    released = http_client().post(f"{c.server.url}/v1/kv/release", timeout=TIMEOUT_S, json={
        "remote_request_id": held["remote_request_id"], "signature": held["signature"]})
    assert released.json() == {"released": True}


def cache_salt(c: Client) -> None:
    prompt = {"prompt": " ".join(["salted"] * 40)} if not c.chat else {
        "messages": [{"role": "user", "content": " ".join(["salted"] * 40)}]}
    c.answer(**prompt, max_tokens=1, cache_salt="a")
    assert c.answer(**prompt, max_tokens=1, cache_salt="a")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert c.answer(**prompt, max_tokens=1, cache_salt="b")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def return_token_ids(c: Client) -> None:
    choice = c.answer(**GREEDY)["choices"][0]
    assert len(choice["token_ids"]) == 8 and "token_ids" not in c.answer(**GREEDY, return_token_ids=False)["choices"][0]


def resume(c: Client) -> None:
    """A stream taken up after its first 3 tokens goes on as the whole stream went
    (tests/pd/server/test_resume.py holds it to every sampling field)."""
    whole = c.tokens(**GREEDY)
    assert c.refused(**GREEDY, resume={"choices": [{"token_ids": whole[:3]}]})  # needs stream: true
    with http_client().stream("POST", f"{c.server.url}/v1/{c.endpoint}", timeout=TIMEOUT_S, json=(
            {"messages": MESSAGES} if c.chat else {"prompt": PROMPT}) | GREEDY | {
            "stream": True, "return_token_ids": True, "resume": {"choices": [{"token_ids": whole[:3]}]}}) as response:
        assert response.status_code == 200
        rest = [t for line in response.iter_lines() if line.startswith("data: {")
                for choice in json.loads(line[6:])["choices"] for t in choice.get("token_ids", [])]
    assert whole[:3] + rest == whole


def logit_bias(c: Client) -> None:
    assert c.tokens(**GREEDY, logit_bias={"1000": 100}) == [1000] * 8


def penalized(c: Client, **penalty) -> None:
    """A token of the prompt made likely: penalized (for repeating the prompt or, once
    output, itself), it gives way."""
    token = c.answer(max_tokens=1)["choices"][0]["prompt_token_ids"][3]
    favoured = [GREEDY | {"logit_bias": {str(token): bias}} for bias in (1.0, 2.0)]
    assert any(c.tokens(**body, **penalty) != c.tokens(**body) for body in favoured)


def presence_penalty(c: Client) -> None:
    penalized(c, presence_penalty=2.0)


def frequency_penalty(c: Client) -> None:
    penalized(c, frequency_penalty=2.0)


def repetition_penalty(c: Client) -> None:
    penalized(c, repetition_penalty=2.0)


def constrained(c: Client, **constraint) -> str:
    return c.text(**SAMPLED | {"max_tokens": 30, "ignore_eos": False}, **constraint)


def response_format(c: Client) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    text = constrained(c, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert json.loads(text)["a"] in ("x", "y")
    assert c.refused(response_format={"type": "grammar"})


def structured_outputs(c: Client) -> None:
    assert re.fullmatch(r"[ab]{4}", constrained(c, structured_outputs={"regex": "[ab]{4}"}))


def guided_json(c: Client) -> None:
    assert json.loads(constrained(c, guided_json={"enum": ["yes", "no"]})) in ("yes", "no")


def guided_regex(c: Client) -> None:
    assert re.fullmatch(r"[0-9]{5}", constrained(c, guided_regex="[0-9]{5}"))


def guided_choice(c: Client) -> None:
    assert constrained(c, guided_choice=["north", "south"]) in ("north", "south")


def guided_grammar(c: Client) -> None:
    assert re.fullmatch(r"go [0-9]", constrained(c, guided_grammar='start: "go " /[0-9]/'))


# completions only


def prompt(c: Client) -> None:
    assert c.tokens(**GREEDY, prompt="Another prompt entirely") != c.tokens(**GREEDY)


def logprobs(c: Client) -> None:
    if c.chat:
        content = c.answer(**GREEDY, logprobs=True)["choices"][0]["logprobs"]["content"]
        assert len(content) == 8 and c.answer(**GREEDY)["choices"][0]["logprobs"] is None
    else:
        assert len(c.answer(**GREEDY, logprobs=2)["choices"][0]["logprobs"]["top_logprobs"]) == 8


def echo(c: Client) -> None:
    assert c.text(**GREEDY, echo=True) == PROMPT + c.text(**GREEDY)


def suffix(c: Client) -> None:
    assert c.refused(suffix="the end")


# chat only


def messages(c: Client) -> None:
    assert c.tokens(**GREEDY, messages=[{"role": "user", "content": "Something else"}]) != c.tokens(**GREEDY)


def prompt_tokens(c: Client, **fields) -> int:
    return c.answer(max_tokens=1, **fields)["usage"]["prompt_tokens"]


def max_completion_tokens(c: Client) -> None:
    assert c.answer(max_completion_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def add_generation_prompt(c: Client) -> None:
    assert prompt_tokens(c, add_generation_prompt=False) < prompt_tokens(c)


def chat_template_kwargs(c: Client) -> None:
    assert prompt_tokens(c, chat_template_kwargs={"enable_thinking": False}) > prompt_tokens(c)


def top_logprobs(c: Client) -> None:
    content = c.answer(**GREEDY, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(token["top_logprobs"]) == 3 for token in content)
    assert c.refused(top_logprobs=3)  # without logprobs: true


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}}}


def tools(c: Client) -> None:
    assert prompt_tokens(c, tools=[TOOL]) > prompt_tokens(c)


def tool_choice(c: Client) -> None:
    forced = SAMPLED | {"max_tokens": 40, "tools": [TOOL], "tool_choice": "required"}
    call = c.answer(**forced)["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"])["x"] in (1, 2)
    assert c.refused(tool_choice="required")  # without tools


def parallel_tool_calls(c: Client) -> None:
    """With end-of-turn pushed away, a required call is followed by more calls, unless
    parallel calls are off (then the grammar ends after one)."""
    ends = {str(token_id(c.server, t)): -100 for t in ("<|im_end|>", "<|endoftext|>")}
    body = SAMPLED | {"max_tokens": 100, "tools": [TOOL], "tool_choice": "required", "logit_bias": ends}
    many = c.answer(**body)["choices"][0]["message"]["tool_calls"]
    one = c.answer(**body, parallel_tool_calls=False)["choices"][0]
    assert len(many) > 1 and len(one["message"]["tool_calls"]) == 1 and one["finish_reason"] == "tool_calls"


CHECKS: dict[str, dict[str, Callable[[Client], None]]] = {"completions": {}, "chat/completions": {}}
SHARED = [model, max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, min_tokens, n,
          best_of, stream, stream_options, user, kv_transfer_params, cache_salt, return_token_ids, resume, logit_bias,
          presence_penalty, frequency_penalty, repetition_penalty, response_format, structured_outputs, guided_json,
          guided_regex, guided_choice, guided_grammar, logprobs]
for check in SHARED + [prompt, echo, suffix]:
    CHECKS["completions"][check.__name__] = check
for check in SHARED + [messages, max_completion_tokens, add_generation_prompt, chat_template_kwargs, top_logprobs,
                       tools, tool_choice, parallel_tool_calls]:
    CHECKS["chat/completions"][check.__name__] = check


def test_every_declared_field_has_a_check() -> None:
    """A field added to a request schema without a check here fails this test."""
    assert set(CompletionRequest.model_fields) == set(CHECKS["completions"])
    assert set(ChatCompletionRequest.model_fields) == set(CHECKS["chat/completions"])
    assert BOOKKEEPING - IGNORED_FIELDS <= set(CompletionRequest.model_fields)


@pytest.mark.parametrize("endpoint, field", [(e, f) for e in CHECKS for f in CHECKS[e]])
def test_the_field_is_applied_or_refused(server, endpoint, field) -> None:
    CHECKS[endpoint][field](Client(server, endpoint))
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
