"""Prefill on one `pd serve`, decode on another, KV moved by NIXL (real transfers between
real server processes on 127.0.0.1), held against one colocated server, for every tiny
architecture.

Servers per architecture: `a` and `b`, both `--role both --kv-connector nixl` (each acts
as P for one request and as D for the next: the decision is per request), `c` colocated
without a connector (the reference), and, for the Mamba hybrids, `noskip`: a decode
server started with `--no-skip-partial-groups-on-remote-prefill`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.pd_client import assert_choices_close, choices, complete, p_then_d, p_then_d_choices
from tests.support.server_harness import ARCHS, running_server, started_together

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
HYBRIDS = ("bamba", "granitehybrid")
NUM_PROMPTS = 32
MAX_TOKENS = 8
CONCURRENCY = 8
# Lengths around the block sizes (16; 144 for the hybrids): single tokens, partial,
# exact and just-over blocks, and several blocks.
PROMPT_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 32, 33, 50, 64, 100, 143, 144, 145, 160,
                  200, 250, 287, 288, 289, 300, 350, 400, 431, 432, 433, 470, 500, 550, 600, 700]
assert len(PROMPT_LENGTHS) == NUM_PROMPTS


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 3800) for _ in range(n)]  # clear of every family's special tokens


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def servers(arch, tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"pd-{arch}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models[arch], logs / f"{name}.log", *args, wait=False))
        servers = {"a": start("a", "--kv-connector", "nixl"), "b": start("b", "--kv-connector", "nixl")}
        if arch in HYBRIDS:
            servers["noskip"] = start("noskip", "--kv-connector", "nixl", "--no-skip-partial-groups-on-remote-prefill")
        reference = colocated[arch]  # the colocated answer (started meanwhile if this worker has none yet)
        started_together(stack, *servers.values())
        yield servers | {"c": reference}


def counter(server, name: str) -> float:
    return server.metrics().get(name, 0.0)


def test_32_mixed_prompts_through_p_then_d_give_the_colocated_tokens(servers, arch) -> None:
    """Non-streamed and streamed, A as P for B and B as P for A, 8 at a time; and each
    connector server's own colocated requests are unchanged."""
    rng = random.Random(f"mixed-{arch}")
    prompts = [token_prompt(rng, n) for n in PROMPT_LENGTHS]
    a, b, c = servers["a"], servers["b"], servers["c"]
    reads_before = counter(a, "pd_kv_transfer_reads_total") + counter(b, "pd_kv_transfer_reads_total")

    def run(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        expected = complete(c, body)
        p, d = (a, b) if i % 2 == 0 else (b, a)
        got = p_then_d(p, d, body)
        assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "length"), i
        assert got.body["usage"]["completion_tokens"] == MAX_TOKENS
        assert got.body["usage"]["prompt_tokens"] == len(prompts[i])
        streamed = p_then_d(d, p, body, streamed=True)  # the other way round
        assert (streamed.token_ids, streamed.text, streamed.finish_reason) == (expected.token_ids, expected.text,
                                                                               "length"), i
        assert complete(p, body).token_ids == expected.token_ids  # colocated on a connector server

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(run, range(NUM_PROMPTS)))
    reads = counter(a, "pd_kv_transfer_reads_total") + counter(b, "pd_kv_transfer_reads_total") - reads_before
    assert reads == 2 * NUM_PROMPTS  # every decode read from P; none fell back to recomputing
    for server in (a, b):
        assert counter(server, "pd_kv_transfer_failures_total") == 0
        assert server.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_chat_through_p_then_d_gives_the_colocated_tokens(servers) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea and its tides."}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = complete(servers["c"], body, endpoint="chat/completions")
    for streamed in (False, True):
        got = p_then_d(servers["a"], servers["b"], body, streamed, endpoint="chat/completions")
        assert (got.token_ids, got.text) == (expected.token_ids, expected.text)


def read_bytes_of_a_family(p, d, rng: random.Random, c) -> list[float]:
    """Two requests sharing a 500-token prefix, P then D; the bytes D read for each."""
    base = token_prompt(rng, 500)
    read = []
    for _ in range(2):
        body = {"prompt": base + token_prompt(rng, 40), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        before = counter(d, "pd_kv_transfer_bytes_total")
        assert p_then_d(p, d, body).token_ids == complete(c, body).token_ids
        read.append(counter(d, "pd_kv_transfer_bytes_total") - before)
    return read


def prefix_hits(server) -> float:
    """Prompt tokens served from the prefix cache, after the reduction across groups."""
    return counter(server, "pd_prefix_cache_hits_total")


def test_a_shared_prefix_makes_d_read_only_the_blocks_it_lacks(servers, arch) -> None:
    hits_before = prefix_hits(servers["b"])
    read = read_bytes_of_a_family(servers["a"], servers["b"], random.Random(f"family-{arch}"), servers["c"])
    assert 0 < read[1] < read[0], read  # D pulled only the blocks past its own prefix hit
    assert prefix_hits(servers["b"]) > hits_before  # the blocks it received earlier were hits


@pytest.mark.parametrize("arch", HYBRIDS, indirect=True)
def test_without_the_per_request_mamba_skip_ds_attention_hits_collapse(servers, arch) -> None:
    """Same family shape on a `--no-skip-partial-groups-on-remote-prefill` D: the Mamba group has no state at
    the shared prefix's boundary on D (it received only P's final state), so the hit
    reduction drops to zero and the second request reads as much as the first. (Each
    group's own hit, pd_prefix_cache_hits_total{group=...}, still shows attention's.)"""
    skip = read_bytes_of_a_family(servers["a"], servers["b"], random.Random(f"skip-{arch}"), servers["c"])
    hits_before = prefix_hits(servers["noskip"])
    noskip = read_bytes_of_a_family(servers["a"], servers["noskip"], random.Random(f"noskip-{arch}"), servers["c"])
    assert noskip[1] == noskip[0] == skip[0], (skip, noskip)
    assert skip[1] < noskip[1]
    assert prefix_hits(servers["noskip"]) == hits_before


def test_a_decode_server_frees_everything_and_p_holds_nothing_afterwards(servers) -> None:
    for server in servers.values():
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
        if "pd_kv_requests_held" in server.metrics():
            assert server.metrics()["pd_kv_requests_held"] == 0


def test_logit_bias_min_p_and_penalties_apply_on_p_and_d_alike(servers) -> None:
    """P samples the first token and D the rest: both apply the request's bias, min-p and
    penalties (D's history holds P's first token), so PD gives the colocated tokens,
    greedy and seeded."""
    a, b, c = servers["a"], servers["b"], servers["c"]
    prompt = token_prompt(random.Random("bias"), 40)
    plain = complete(c, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    forced = complete(c, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                          "logit_bias": {"1234": 100}})
    assert forced.token_ids == [1234] * MAX_TOKENS
    banned = {str(plain.token_ids[0]): -100, str(plain.token_ids[1]): -100}
    for body in ({"temperature": 0, "logit_bias": banned},
                 {"temperature": 0.9, "seed": 7, "min_p": 0.05, "logit_bias": banned | {"777": 3.5}}):
        body |= {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        expected = complete(c, body)
        assert plain.token_ids[0] not in expected.token_ids and plain.token_ids[1] not in expected.token_ids
        for streamed in (False, True):
            assert p_then_d(a, b, body, streamed).token_ids == expected.token_ids
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 1.5}
    expected = complete(c, body)
    assert len(set(expected.token_ids)) == MAX_TOKENS  # a token already output loses 3 logits: none repeats
    for streamed in (False, True):
        assert p_then_d(b, a, body, streamed).token_ids == expected.token_ids


def test_min_tokens_holds_back_stops_on_p_and_d_alike(servers) -> None:
    """A token of the plain answer made a stop token: without min_tokens the answer ends
    at its first place; with min_tokens=5 that token is not picked before 5 tokens, and P (the first
    token) and D (the rest) give the colocated answer. A stop string matching the first
    token's text does not stop a request short of its min_tokens either."""
    a, b, c = servers["a"], servers["b"], servers["c"]
    prompt = token_prompt(random.Random("min_tokens"), 30)
    base = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    plain = complete(c, base | {"ignore_eos": True})
    stop_id = plain.token_ids[1]
    first = plain.token_ids.index(stop_id)
    stopped = complete(c, base | {"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert stopped.token_ids == plain.token_ids[:first + 1] and stopped.finish_reason == "stop"
    body = base | {"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 5}
    expected = complete(c, body)
    assert len(expected.token_ids) >= 5 and stop_id not in expected.token_ids[:5]
    for streamed in (False, True):
        assert p_then_d(a, b, body, streamed).token_ids == expected.token_ids
    first_text = complete(c, base | {"ignore_eos": True, "max_tokens": 1}).text
    if first_text.strip():
        cut = complete(c, base | {"ignore_eos": True, "stop": [first_text]})
        assert cut.text == "" and cut.finish_reason == "stop"
        held = complete(c, base | {"ignore_eos": True, "stop": [first_text], "min_tokens": 3})
        assert held.text.startswith(first_text) and len(held.token_ids) >= 3


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_logprobs_echo_and_n_through_p_then_d_give_the_colocated_answer(servers, arch, endpoint) -> None:
    """P samples each sequence's first token and scores it (and, echoing, the prompt);
    D answers those and decodes the rest of each sequence from P's KV: the choices equal
    the colocated server's, texts and tokens exactly and logprobs to 1e-5, streamed and not."""
    a, b, c = servers["a"], servers["b"], servers["c"]
    prompt = token_prompt(random.Random(f"logprobs-{arch}"), 150)
    base = {"max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 17, "ignore_eos": True, "return_token_ids": True}
    if endpoint == "completions":
        bodies = [base | {"prompt": prompt, "n": 3, "logprobs": 3, "echo": True},
                  base | {"prompt": prompt, "n": 2, "best_of": 3}]
    else:
        messages = [{"role": "user", "content": "Tell me about the sea and its tides."}]
        bodies = [base | {"messages": messages, "n": 3, "logprobs": True, "top_logprobs": 2}]
    for body in bodies:
        expected = choices(c, body, endpoint)
        assert len({tuple(choice["token_ids"]) for choice in expected}) == len(expected) > 1
        for streamed in (False, True) if "best_of" not in body else (False,):
            assert_choices_close(p_then_d_choices(a, b, body, streamed, endpoint), expected)
    for server in (a, b):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_grammar_is_followed_on_p_and_d_alike(servers, arch) -> None:
    """P samples each sequence's first token under the grammar; D's matchers take those
    tokens, then mask the rest: the colocated answer, ending where the grammar ends."""
    a, b, c = servers["a"], servers["b"], servers["c"]
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                               "v": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["k", "v"], "additionalProperties": False}
    body = {"prompt": token_prompt(random.Random(f"grammar-{arch}"), 60), "max_tokens": 40, "temperature": 0.9,
            "seed": 4, "n": 2, "guided_json": schema, "return_token_ids": True}
    expected = choices(c, body)
    for choice in expected:
        value = json.loads(choice["text"])
        assert set(value) == {"k", "v"} and choice["finish_reason"] == "stop"
    for streamed in (False, True):
        assert_choices_close(p_then_d_choices(a, b, body, streamed), expected)


@pytest.mark.parametrize("arch", ["qwen3"], indirect=True)
def test_forced_tool_calls_through_p_then_d_are_the_colocated_calls(servers, arch) -> None:
    """Only the Qwen3 template shows tools. P's first token is the call's opening tag under
    the tool grammar; D writes the rest of each call: the colocated calls, streamed or not."""
    a, b, c = servers["a"], servers["b"], servers["c"]
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"],
        "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "Look it up."}], "tools": [tool], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0.9, "seed": 8, "n": 2,
            "return_token_ids": True}

    def without_ids(answer: list[dict]) -> list[dict]:
        for choice in answer:
            for call in choice["message"].get("tool_calls", []):
                call.pop("id")
        return answer

    expected = without_ids(choices(c, body, "chat/completions"))
    assert all(choice["message"]["tool_calls"] and choice["finish_reason"] == "tool_calls" for choice in expected)
    assert_choices_close(without_ids(p_then_d_choices(a, b, body, False, "chat/completions")), expected)
