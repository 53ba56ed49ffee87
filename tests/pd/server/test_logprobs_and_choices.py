"""logprobs / top_logprobs, echo, n and best_of on a live `pd serve`: logprobs held
against transformers' log-softmax on the same checkpoint, echo as lm-evaluation-harness
reads it, streamed answers equal to unstreamed ones, n sequences equal to separate
seeded requests, best_of's pick, and a stop string ending one sequence of several."""

from __future__ import annotations

import math

import pytest
import torch

from launch import http_client
from tests.support.pd_client import TIMEOUT_S, assert_choices_close, choices

PROMPT = "The lighthouse keeper counted the ships that passed the rocks each night"


@pytest.fixture(scope="module")
def server(colocated):
    return colocated["qwen3"]  # the worker's plain qwen3 server: these tests leave it as they found it


@pytest.fixture(scope="module")
def hf(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    return logprobs


def post(server, body: dict, endpoint: str = "completions") -> dict:
    response = http_client().post(f"{server.url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def kv_usage(server) -> float:
    return server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0)


def test_completion_logprobs_equal_transformers(server, hf) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True,
            "return_token_ids": True}
    choice = post(server, body)["choices"][0]
    prompt, tokens = choice["prompt_token_ids"], choice["token_ids"]
    reference = hf(prompt + tokens)[len(prompt) - 1:-1]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["top_logprobs"]) == 6
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(6)]
    for i, token in enumerate(tokens):
        assert math.isclose(logprobs["token_logprobs"][i], reference[i, token].item(), abs_tol=1e-4)
        top = sorted(logprobs["top_logprobs"][i].values(), reverse=True)
        assert torch.allclose(torch.tensor(top[:3]), reference[i].topk(3).values, atol=1e-4)
        assert logprobs["token_logprobs"][i] == top[0]  # greedy: the token is the most likely


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server, hf) -> None:
    """lm-evaluation-harness sends token ids, echo, logprobs=1 and max_tokens=1, and sums
    token_logprobs[context:-1]: the prompt's tokens, then one generated token."""
    prompt = post(server, {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True})["choices"][0][
        "prompt_token_ids"]
    body = {"prompt": [prompt], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    choice = post(server, body)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(prompt) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = hf(prompt)
    context = 5
    expected = sum(reference[i - 1, prompt[i]].item() for i in range(context, len(prompt)))
    assert math.isclose(sum(logprobs["token_logprobs"][context:-1]), expected, abs_tol=1e-3)
    greedy = [reference[i - 1].argmax().item() == prompt[i] for i in range(1, len(prompt))]
    is_greedy = [lp == max(top.values()) for lp, top in zip(logprobs["token_logprobs"][1:-1],
                                                          logprobs["top_logprobs"][1:-1])]
    assert is_greedy == greedy
    assert choice["text"].startswith(server_text(server, prompt))
    only_prompt = post(server, body | {"max_tokens": 0})["choices"][0]
    assert only_prompt["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]
    assert only_prompt["text"] == server_text(server, prompt)


def server_text(server, token_ids: list[int]) -> str:
    """The prompt's text as echo shows it (special tokens spelled out)."""
    return post(server, {"prompt": token_ids, "max_tokens": 0, "echo": True})["choices"][0]["text"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_streamed_answers_equal_unstreamed_ones(server, endpoint) -> None:
    body = {"max_tokens": 8, "temperature": 0.8, "seed": 11, "n": 3, "ignore_eos": True, "return_token_ids": True}
    if endpoint == "completions":
        body |= {"prompt": PROMPT, "logprobs": 2, "echo": True}
    else:
        body |= {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 2}
    whole = choices(server, body, endpoint)
    assert [c["index"] for c in whole] == [0, 1, 2] and len({c["finish_reason"] for c in whole}) == 1
    assert_choices_close(choices(server, body, endpoint, streamed=True), whole, atol=0)
    assert kv_usage(server) == 0


def test_chat_logprobs_equal_completion_logprobs_of_the_rendered_prompt(server) -> None:
    chat = post(server, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0,
                         "logprobs": True, "top_logprobs": 3, "return_token_ids": True, "ignore_eos": True},
                "chat/completions")["choices"][0]
    completion = post(server, {"prompt": chat["prompt_token_ids"], "max_tokens": 5, "temperature": 0, "logprobs": 3,
                               "ignore_eos": True})["choices"][0]["logprobs"]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == completion["tokens"]
    assert [c["logprob"] for c in content] == completion["token_logprobs"]
    for entry, top in zip(content, completion["top_logprobs"]):
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] == max(top.values())
        assert sorted(t["logprob"] for t in entry["top_logprobs"]) == sorted(top.values())[-3:]


def test_n_sequences_equal_separately_seeded_requests(server) -> None:
    """Sequence j samples as a request seeded with seed + j (vLLM's convention)."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "logprobs": 1,
            "return_token_ids": True}
    together = choices(server, body | {"n": 4, "seed": 40})
    assert len({tuple(c["token_ids"]) for c in together}) == 4
    alone = [choices(server, body | {"seed": 40 + j})[0] | {"index": j} for j in range(4)]
    assert_choices_close(together, alone)


def test_best_of_answers_the_most_likely_sequences(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.2, "seed": 9, "ignore_eos": True, "logprobs": 0}
    every = choices(server, body | {"n": 5})
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = choices(server, body | {"n": 2, "best_of": 5})
    assert [c["text"] for c in best] == [c["text"] for c in ranked[:2]] and [c["index"] for c in best] == [0, 1]
    unscored = choices(server, {k: v for k, v in body.items() if k != "logprobs"} | {"n": 2, "best_of": 5})
    assert [c["text"] for c in unscored] == [c["text"] for c in best]
    assert all(c["logprobs"] is None for c in unscored)  # ranked by them, not shown unasked


def test_a_stop_string_ends_only_its_own_sequence(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": True,
            "return_token_ids": True}
    plain = choices(server, body)
    stop = plain[1]["text"][4:7]
    assert stop and stop not in plain[0]["text"] + plain[2]["text"], "pick another seed: the stop string is shared"
    for streamed in (False, True):
        cut = choices(server, body | {"stop": [stop]}, streamed=streamed)
        assert cut[1]["finish_reason"] == "stop" and cut[1]["text"] == plain[1]["text"][:plain[1]["text"].index(stop)]
        assert [(c["text"], c["finish_reason"]) for c in (cut[0], cut[2])] == [
            (c["text"], "length") for c in (plain[0], plain[2])]
    assert kv_usage(server) == 0
