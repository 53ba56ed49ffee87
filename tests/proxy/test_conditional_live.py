"""`--disagg-policy conditional` in front of real servers (1P1D, NIXL, D's KV events): a
conversation's first turn is prefilled on P; each next turn, whose earlier turns and
answers the decode server holds, is prefilled on D itself (no P, no transfer), finds
them in D's prefix cache, and answers what a colocated server answers, streamed or not.
Every family: sliding window (gemma3) and the hybrids (Mamba: bamba, granitehybrid), whose
D skipped Mamba alignment while P prefilled, too."""

from __future__ import annotations

import contextlib
import os
import random

import pytest

from launch import http_client
from tests.support.pd_client import complete, stream
from tests.support.proxy_fakes import proxy_metric, wait_until
from tests.support.server_harness import Starter, running_proxy

pytestmark = pytest.mark.slow
NEW, ANSWER = 10, 12  # tokens of each next user message, of each answer


def published_events() -> list[str]:
    """A decode server's flags to publish its KV events."""
    return ["--kv-events-port", "0"]  # both sockets on ports the kernel picks as they bind; /v1/kv_config says


def local_max(block: int) -> int:
    """`--local-prefill-max-tokens`: past what a next turn lacks (its new message, the last
    answer, and the last turn's block not full: D holds full blocks only)."""
    return block + NEW + ANSWER


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "bamba", "granitehybrid"])
def deployment(request, tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"conditional-{request.param}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = Starter(tiny_models[request.param], logs, stack)
        p, d = start.all(("p", "--role", "prefill"), ("d", "--role", "decode", *published_events()))
        config = http_client().get(f"{d.url}/v1/kv_config", timeout=10).json()
        block = config["groups"][config["routing_group"]]["block_size"]  # 16, or 144 for bamba's Mamba pages
        front = stack.enter_context(running_proxy(
            logs / "proxy.log", "--prefill", p.url, "--decode", d.url, "--disagg-policy", "conditional",
            "--local-prefill-max-tokens", str(local_max(block)), "--reuse-min-tokens", str(block),
            "--probe-interval", "0.5"))
        yield request.param, block, p, d, front


def decode_blocks(front) -> int:
    state = http_client().get(f"{front.url}/health", timeout=5).json()["decode"][0]["kv_index"]
    return 0 if state is None else state["blocks"]


def all_decode_blocks(front) -> int:
    states = [d["kv_index"] for d in http_client().get(f"{front.url}/health", timeout=5).json()["decode"]]
    return sum(0 if state is None else state["blocks"] for state in states)


def paths(front) -> dict[str, float]:
    return {path: proxy_metric(front.url, f'pd_proxy_requests_by_path_total{{path="{path}"}}')
            for path in ("local", "disaggregated", "disaggregated+reuse")}


def conversation(deployment, reference, seed: int, first: int, turns: list[tuple[str, int]], streamed: int):
    """Send a conversation's turns through the proxy: `first` tokens, then for turn k of
    `turns` = (path it must take, new message tokens), the last turn's prompt, its answer
    and the new message (turn 0's message is ignored); turn `streamed` streamed. Each
    answer must be `reference`'s. Yields (k, answer, full blocks of the last turn D holds)."""
    arch, block, p, d, front = deployment
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(10, 200) for _ in range(n)]  # noqa: E731
    prompt, answer, held = words(first), [], 0
    for k, (expected, new) in enumerate(turns):
        if k:
            held = (len(prompt) + len(answer) - 1) // block  # full blocks of the last turn D computed or read
            prompt = prompt + answer + words(new)
            assert wait_until(lambda held=held: decode_blocks(front) >= held, 30), (decode_blocks(front), held)
        before = paths(front)
        body = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
        got = stream(front, body) if k == streamed else complete(front, body)
        assert got.token_ids == complete(reference, body).token_ids, (arch, k)
        assert paths(front)[expected] == before[expected] + 1, (k, paths(front), before)
        yield k, got, held
        answer = got.token_ids


def test_the_next_turns_are_prefilled_on_d_from_its_cache_and_answer_as_colocated(deployment, colocated) -> None:
    arch, block, p, d, front = deployment
    turns = [("disaggregated", 0), ("local", NEW), ("local", NEW)]
    for k, got, held in conversation(deployment, colocated[arch], 7, 4 * block + 4, turns, streamed=2):
        if k == 1 and arch == "qwen3":  # a hybrid's D holds no Mamba state where the turn could resume
            assert got.body["usage"]["prompt_tokens_details"]["cached_tokens"] >= (held - 1) * block
    assert http_client().get(f"{front.url}/health", timeout=5).json()["prefill"][0]["requests"] == 1  # turn 1
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_long_next_turn_is_prefilled_on_p_reading_what_d_holds_first(deployment, colocated) -> None:
    """A conversation opened on D (its first turn short: computed there), then a turn
    with a long new message: P reads from D the blocks of the first turn and its answer
    (which P never saw) and computes only the new message; D reads from P what it lacks.
    Then a short turn on D again. Tokens are colocated's at every turn."""
    arch, block, p, d, front = deployment
    read_by_p = proxy_metric(p.url, 'pd_prompt_tokens_by_source_total{source="remote"}')
    turns = [("local", 0), ("disaggregated+reuse", local_max(block) + 2 * block), ("local", NEW)]
    for k, _, held in conversation(deployment, colocated[arch], 9, local_max(block) - 8, turns, streamed=1):
        if k == 1:  # P read the first turn's full blocks from D
            read = proxy_metric(p.url, 'pd_prompt_tokens_by_source_total{source="remote"}') - read_by_p
            assert read == held * block, (read, held)
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_next_turn_whose_prefix_p_prefilled_reads_nothing_and_is_no_load_failure(deployment, colocated) -> None:
    """A first turn prefilled on P, then a long turn: D exports what it holds, but P (whose
    events this proxy does not follow) holds that prefix already. It reads nothing and
    counts no load failure (the probe saw every such Bamba turn counted as one, the
    reason nowhere): the read skipped is counted and logged, D frees its export."""
    arch, block, p, d, front = deployment
    before = p.metrics()
    turns = [("disaggregated", 0), ("disaggregated+reuse", local_max(block) + 2 * block)]
    for _ in conversation(deployment, colocated[arch], 13, 4 * block + 4, turns, streamed=1):
        pass
    after = p.metrics()
    failures = 'pd_kv_load_failures_total{policy="recompute"}'
    assert after[failures] == before[failures]
    assert after["pd_kv_prefix_reads_skipped_total"] == before["pd_kv_prefix_reads_skipped_total"] + 1
    assert after['pd_prompt_tokens_by_source_total{source="remote"}'] == \
        before['pd_prompt_tokens_by_source_total{source="remote"}']
    assert "reads no prefix from the decode server" in p.log_tail(20000)
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


@pytest.fixture(scope="module")
def two_decoders(tiny_models, tmp_path_factory):
    """1P2D qwen3 behind a conditional proxy with no --decode-policy (kv_aware by default)."""
    logs = tmp_path_factory.mktemp("conditional-2d")
    with contextlib.ExitStack() as stack:
        start = Starter(tiny_models["qwen3"], logs, stack)
        p, *ds = start.all(("p", "--role", "prefill"), ("d0", "--role", "decode", *published_events()),
                           ("d1", "--role", "decode", *published_events()))
        front = stack.enter_context(running_proxy(
            logs / "proxy.log", "--prefill", p.url, "--decode", *(d.url for d in ds), "--disagg-policy", "conditional",
            "--local-prefill-max-tokens", str(local_max(16)), "--probe-interval", "0.5"))
        yield p, ds, front


def test_each_next_turn_goes_to_the_decode_server_holding_its_conversation(two_decoders, colocated) -> None:
    """Four conversations over two decode servers; each round of turns in another order of
    conversations (round robin would then send a next turn where nothing is held): every
    next turn lands on its conversation's decode server and is prefilled there."""
    p, ds, front = two_decoders
    rng = random.Random(11)
    words = lambda n: [rng.randrange(10, 200) for _ in range(n)]  # noqa: E731
    prompts = [words(5 * 16 + 3) for _ in range(4)]
    home: dict[int, str] = {}
    held = [0] * 4  # full blocks of each conversation's last turn on its decode server
    for turn, order in enumerate([[0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 1, 0]]):
        assert wait_until(lambda: all_decode_blocks(front) >= sum(held), 30), (all_decode_blocks(front), held)
        for c in order:
            body = {"prompt": prompts[c], "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            response = http_client().post(f"{front.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            decode = response.headers["X-PD-Decode"].split(";")[0]
            assert response.headers["X-PD-Path"] == ("disaggregated" if turn == 0 else "local"), (turn, c)
            assert home.setdefault(c, decode) == decode, (turn, c, home)
            tokens = response.json()["choices"][0]["token_ids"]
            assert tokens == complete(colocated["qwen3"], body).token_ids, (turn, c)
            held[c] = (len(prompts[c]) + len(tokens) - 1) // 16
            prompts[c] = prompts[c] + tokens + words(NEW)
    assert sorted(set(home.values())) == ["0", "1"]  # the conversations were spread over both
    for server in (p, *ds):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_decode_server_lacking_what_the_decision_counted_on_computes_it(tiny_models, tmp_path, colocated) -> None:
    """The proxy let D prefill the next turn on blocks D no longer holds (evicted between
    the decision and the prefill; here D caches nothing, so the blocks the proxy expects
    on it after the last turn are never there): D computes the whole prompt, the answer is
    colocated's, nothing fails and no block is left. Then a long turn, whose prefix the
    proxy has D export for P: D computes the prefix it lacks, P reads it, same answer."""
    with contextlib.ExitStack() as stack:
        start = Starter(tiny_models["qwen3"], tmp_path, stack)
        p, d = start.all(("p", "--role", "prefill"),
                         ("d", "--role", "decode", "--no-enable-prefix-caching", *published_events()))
        front = stack.enter_context(running_proxy(
            tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url, "--disagg-policy", "conditional",
            "--local-prefill-max-tokens", str(local_max(16)), "--reuse-min-tokens", "16", "--probe-interval", "0.5"))
        rng = random.Random(5)
        prompt = [rng.randrange(10, 200) for _ in range(5 * 16 + 3)]
        turns = [("disaggregated", NEW), ("local", 3 * 16), ("disaggregated+reuse", 0)]
        for k, (expected, new) in enumerate(turns):  # each next one within the expectation's 10 s
            body = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            response = http_client().post(f"{front.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200 and response.headers["X-PD-Path"] == expected, (k, response.text)
            tokens = response.json()["choices"][0]["token_ids"]
            assert tokens == complete(colocated["qwen3"], body).token_ids, k
            if k == 1:
                assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # all computed on D
            prompt = prompt + tokens + [rng.randrange(10, 200) for _ in range(new)]
        assert decode_blocks(front) == 0  # D published nothing: the proxy only expected
        for server in (p, d):
            assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
