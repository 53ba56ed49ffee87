"""`usage.prompt_tokens_details` on live servers: `cached_tokens` is every prompt token
whose KV was not computed for the request, and `sources` says where each came from, for
a local prefix-cache hit, a hit in the disk tier (the probe saw 0 for 13,504 tokens
loaded from disk), and a request through prefill/decode disaggregation, where what the
decode server read from the prefill server counts as P computed it (a fresh prompt is no
cache hit because it moved between servers), and P's own hit counts as cached."""

from __future__ import annotations

import contextlib
import random

import pytest

from tests.support.pd_client import complete, p_then_d, prefill
from tests.support.server_harness import running_server, started_together

pytestmark = pytest.mark.slow
ARCH = "qwen3"
CACHE = "2400000"  # bytes of KV cache: about one 300-token prompt's
BLOCK = 16


def body(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("prompt-sources")
    flags = ("--kv-connector", "nixl", "--max-model-len", "512", "--kv-cache-memory", CACHE)
    with contextlib.ExitStack() as stack:
        p, d = (stack.enter_context(running_server(tiny_models[ARCH], logs / f"{name}.log", *flags,
                                                   "--kv-offload-disk-path", str(logs / name), wait=False))
                for name in ("p", "d"))
        started_together(stack, p, d)
        yield p, d


def details(answer) -> dict:
    usage = answer.body["usage"]
    out = usage["prompt_tokens_details"]
    assert sum(out["sources"].values()) == usage["prompt_tokens"]  # every prompt token came from somewhere
    assert out["cached_tokens"] == usage["prompt_tokens"] - out["sources"]["computed"]
    return out


def prompts(seed: int, count: int = 1, length: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 3800) for _ in range(length)] for _ in range(count)]


def test_a_local_prefix_hit_is_cached(servers) -> None:
    _, d = servers
    (prompt,) = prompts(1)
    assert details(complete(d, body(prompt)))["sources"] == {"computed": 300, "local_cache": 0}
    hit = 299 // BLOCK * BLOCK  # full blocks short of the last token, which is always computed
    assert details(complete(d, body(prompt))) == {"cached_tokens": hit,
                                                  "sources": {"computed": 300 - hit, "local_cache": hit}}


def test_a_prompt_loaded_from_the_disk_tier_is_cached(servers) -> None:
    _, d = servers
    first, *others = prompts(2, count=4)
    complete(d, body(first))
    for other in others:  # the cache holds about one prompt: these push the first out of it
        complete(d, body(other))
    again = details(complete(d, body(first)))
    assert again["sources"].get("disk", 0) > 0, again
    assert again["cached_tokens"] == again["sources"]["disk"] + again["sources"]["local_cache"] > 0


def test_a_pd_request_counts_what_p_did_not_compute(servers) -> None:
    p, d = servers
    (prompt,) = prompts(3)
    computed = {"cached_tokens": 0, "sources": {"computed": 300, "local_cache": 0}}
    on_p = prefill(p, body(prompt))
    assert details(on_p) == computed
    on_d = complete(d, body(prompt) | {"kv_transfer_params": on_p.body["kv_transfer_params"]})
    assert details(on_d) == computed  # D read all of it from P, which computed it
    hit = 299 // BLOCK * BLOCK  # full blocks short of the last token, which is always computed
    again = details(p_then_d(p, d, body(prompt)))  # P hits its cache now, and says so
    assert again == {"cached_tokens": hit, "sources": {"computed": 300 - hit, "local_cache": hit}}
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
