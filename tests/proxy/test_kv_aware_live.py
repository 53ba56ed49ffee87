"""`--policy kv_aware` in front of real servers publishing their KV events (2P2D): the
conversations behind one long system prompt stay each on the prefill server that holds
its last turn, where prefix_aware sends them all to one; a prefix a server evicted is no
longer counted; a proxy started late catches up through replay; a restarted server
starts empty. Which server the proxy picked, and the prompt tokens it expected it to
hold, come back in the X-PD-Prefill / X-PD-Decode headers."""

from __future__ import annotations

import contextlib
import os

import pytest

from launch import http_client
from tests.support.proxy_fakes import wait_until
from tests.support.server_harness import running_proxy, running_server

pytestmark = pytest.mark.slow
SYSTEM = ("You are the harbour master's assistant. Answer questions about ships, tides, moorings and the "
          "lighthouse schedule. Keep answers short, list numbers plainly, and never guess a tide table. ") * 4
assert len(SYSTEM) > 256  # past prefix_aware's key: every conversation hashes alike
# Each first user message differs from its first word: nothing past the system prompt is shared.
TOPICS = ["Ferries: the night one from the north pier", "Barges: the coal one that lost its anchor",
          "Regattas: the one on the first Sunday of June", "Storms: the warnings for the coming week"]


def events_flags() -> list[str]:
    return ["--kv-events-port", "0"]  # both sockets on ports the kernel picks as they bind; /v1/kv_config says


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-aware")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    flags: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        def start(name: str, *args: str):
            flags[name] = [*args, *events_flags()]
            return stack.enter_context(running_server(tiny_models["qwen3"], logs / f"{name}.log", *flags[name]))

        servers = {"p": [start("p0", "--role", "prefill"), start("p1", "--role", "prefill")],
                   "d": [start("d0", "--role", "decode"), start("d1", "--role", "decode")], "logs": logs,
                   "flags": flags}
        yield servers


@contextlib.contextmanager
def proxy(servers, policy: str, name: str | None = None):
    with running_proxy(servers["logs"] / f"proxy-{name or policy}.log", "--policy", policy,
                       "--prefill", *(s.url for s in servers["p"]), "--decode", *(s.url for s in servers["d"]),
                       "--probe-interval", "0.5") as front:
        if policy == "kv_aware":  # following every server's events
            assert wait_until(lambda: all(i["kv_index"] is not None for i in instances(front)), 60)
        yield front


def instances(front) -> list[dict]:
    health = http_client().get(f"{front.url}/health", timeout=5).json()
    return health["prefill"] + health["decode"]


def chat(front, messages: list[dict]) -> tuple[str, int, int]:
    """The answer, the prefill server picked and the prompt tokens it was expected to hold."""
    response = http_client().post(f"{front.url}/v1/chat/completions", timeout=120,
                                  json={"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    index, _, held = response.headers["x-pd-prefill"].partition("; overlap=")
    return response.json()["choices"][0]["message"]["content"], int(index), int(held)


def warm_system_prompt(servers) -> None:
    """Have every prefill server hold the system prompt (asked directly, not through a
    proxy): then no server is preferred for a new conversation, and load spreads them."""
    for server in servers["p"]:
        response = http_client().post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello."}],
            "max_tokens": 1})
        assert response.status_code == 200, response.text


def converse(front, turns: int) -> list[list[tuple[int, int]]]:
    """The conversations' turns, one request at a time, turn by turn: per conversation,
    (P picked, tokens held) per turn."""
    histories = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{t}?"}]
                 for t in TOPICS]
    picks: list[list[tuple[int, int]]] = [[] for _ in TOPICS]
    for turn in range(turns):
        answers = [chat(front, h) for h in histories]
        for history, pick, (text, index, held) in zip(histories, picks, answers):
            pick.append((index, held))
            history += [{"role": "assistant", "content": text},
                        {"role": "user", "content": f"And what happened next, on day {turn + 2}?"}]
    return picks


def test_each_conversation_stays_on_the_prefill_server_holding_its_last_turn(servers) -> None:
    warm_system_prompt(servers)
    with proxy(servers, "kv_aware") as front:
        assert wait_until(lambda: all(i["kv_index"]["blocks"] > 0 for i in instances(front) if i["role"] == "prefill"),
                          30)  # what the servers held before the proxy started, replayed
        picks = converse(front, turns=4)
    for conversation in picks:
        home = conversation[0][0]
        assert [index for index, _ in conversation[1:]] == [home] * 3, picks
        held = [h for _, h in conversation[1:]]
        assert held == sorted(held) and held[0] > 0  # each turn finds more of itself there
    assert {conversation[0][0] for conversation in picks} == {0, 1}, picks  # new conversations spread by load
    with proxy(servers, "prefix_aware") as front:
        ring = converse(front, turns=2)
    assert len({index for conversation in ring for index, _ in conversation}) == 1, ring  # all on one P


def test_a_proxy_started_late_catches_up_and_a_restarted_server_starts_empty(servers, tiny_models) -> None:
    """(Last of the module's tests on `servers`: it restarts one of them.)"""
    prompt = [{"role": "user", "content": "A question about the tide tables of the eastern harbour. " * 6}]
    with proxy(servers, "kv_aware", "warm") as front:
        _, home, _ = chat(front, prompt)
    with proxy(servers, "kv_aware", "late") as front:  # its subscriptions replay what was published before
        assert wait_until(lambda: instances(front)[home]["kv_index"]["blocks"] > 0, 30)  # (a replay takes a moment)
        _, index, held = chat(front, prompt)
        assert index == home and held > 0
        p = servers["p"][home]
        p.process.terminate()
        p.process.wait(30)
        port = int(p.url.rpartition(":")[2])
        with running_server(tiny_models["qwen3"], servers["logs"] / "restarted.log", *servers["flags"][f"p{home}"],
                            port=port):
            restarted = lambda: instances(front)[home]  # noqa: E731
            assert wait_until(lambda: restarted()["healthy"] and restarted()["kv_index"]["blocks"] == 0, 30)
            for _ in range(3):  # the new engine's events are followed from the start
                chat(front, prompt)
            assert wait_until(lambda: restarted()["kv_index"]["blocks"] > 0 or
                              instances(front)[1 - home]["kv_index"]["blocks"] > 0, 30)


@pytest.fixture(scope="module")
def small(tiny_models, tmp_path_factory):
    """1P1D whose P holds only a few prompts' blocks (40 of 16 tokens)."""
    logs = tmp_path_factory.mktemp("kv-evict")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models["qwen3"], logs / f"{name}.log", *args, *events_flags()))
        servers = {"p": [start("p", "--role", "prefill", "--max-model-len", "512", "--kv-cache-memory", str(40 << 16))],
                   "d": [start("d", "--role", "decode", "--max-model-len", "512")], "logs": logs}
        yield servers


def test_a_prefix_the_server_evicted_is_no_longer_counted(small) -> None:
    prompt = [{"role": "user", "content": "The first prompt, the one to be evicted later. " * 8}]
    with proxy(small, "kv_aware") as front:
        chat(front, prompt)
        assert chat(front, prompt)[2] > 0  # held now
        for i in range(12):  # unrelated prompts push it out of P's small cache
            chat(front, [{"role": "user", "content": f"Unrelated prompt number {i}, nothing alike. " * 8}])
        assert chat(front, prompt)[2] == 0
