"""Prefill on one `pd serve`, decode on another, KV moved by NIXL (real transfers between
real server processes on 127.0.0.1), held against one colocated server.

The client plays the proxy: the request goes to P with max_tokens=1 and
kv_transfer_params={"do_remote_decode": true}, then to D with P's kv_transfer_params.
"""

from __future__ import annotations

import contextlib
import os

import httpx
import pytest

from server_harness import running_server

pytestmark = pytest.mark.slow
PROMPTS = [
    "The history of the city begins with a small settlement by the river, where " * 3,
    "Hello",
    "A long time ago " * 25,
]


@pytest.fixture(scope="module", params=["qwen3", "bamba"])
def servers(request, tiny_models, tmp_path_factory):
    arch = request.param
    logs = tmp_path_factory.mktemp(f"pd-{arch}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models[arch], logs / f"{name}.log", *args))
        yield {"p": start("p", "--kv-connector", "nixl"), "d": start("d", "--kv-connector", "nixl"),
               "c": start("c")}


def complete(server, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def p_then_d(servers, body: dict) -> tuple[dict, dict]:
    p = complete(servers["p"], body | {"max_tokens": 1, "stream": False,
                                        "kv_transfer_params": {"do_remote_decode": True}})
    params = p["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["num_prompt_tokens"] == p["usage"]["prompt_tokens"]
    return p, complete(servers["d"], body | {"kv_transfer_params": params})


def test_p_then_d_gives_the_colocated_tokens_without_recomputing(servers) -> None:
    d_before = servers["d"].metrics()
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        p, d = p_then_d(servers, body)
        c = complete(servers["c"], body)
        assert d["choices"][0]["text"] == c["choices"][0]["text"]
        assert d["usage"]["completion_tokens"] == 10
        assert p["choices"][0]["text"] == c["choices"][0]["text"][: len(p["choices"][0]["text"])]
    d_after = servers["d"].metrics()
    assert d_after["pd_kv_transfer_reads_total"] - d_before.get("pd_kv_transfer_reads_total", 0) == len(PROMPTS)
    assert d_after["pd_kv_transfer_failures_total"] == 0
    # D computed no prompt token: it only decoded (10 tokens each, the first came from P)
    assert servers["p"].wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
    assert servers["p"].wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    assert servers["d"].wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_shared_prefix_makes_d_read_fewer_bytes(servers) -> None:
    base = "Shared preamble for every request in this family. " * 12
    read = []
    for suffix in ("first question?", "second, different question?"):
        before = servers["d"].metrics()
        body = {"prompt": base + suffix, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        _, d = p_then_d(servers, body)
        assert d["choices"][0]["text"] == complete(servers["c"], body)["choices"][0]["text"]
        read.append(servers["d"].metrics()["pd_kv_transfer_bytes_total"] - before.get("pd_kv_transfer_bytes_total", 0))
    assert 0 < read[1] < read[0], read  # D pulled only the blocks past its own prefix hit
