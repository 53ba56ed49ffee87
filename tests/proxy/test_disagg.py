"""`--disagg-policy conditional`: the decision (what D lacks against the threshold, P's
queue, no healthy P; what D holds beyond any P, for P to read) and the proxy in front of
fake servers: a request computed on D goes to D as it is, nothing to P, and says so in
`X-PD-Path` and /metrics; a prefix D exports goes to P, and the request goes on without
it when D does not export or P refuses it."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from fastapi.responses import Response

from launch import http_client
from proxy.calls import Call, Prefilled
from proxy.disagg import DISAGGREGATED, LOCAL, REUSE, choose_path, reuse_tokens
from proxy.instances import Instance, InstancePool, Route
from proxy.kv_index import KVIndex
from proxy.main import add_proxy_flags, proxy_config
from proxy.metrics import ProxyMetrics
from proxy.proxy_config import ProxyConfig
from proxy.reuse import prefill_reusing
from proxy.upstream import Upstream
from tests.support.proxy_fakes import (
    COMPLETION,
    FakeServer,
    Reply,
    fake,
    fake_tokens,
    proxy_health,
    proxy_in_front,
    proxy_metric,
    refusing_port,
)

BLOCK = 4


def decode_holding(route: Route, blocks: int) -> Instance:
    """A decode server whose events say it holds the first `blocks` blocks of the prompt."""
    instance = Instance("http://127.0.0.1:1", "decode", kv_index=KVIndex(), block_size=BLOCK)
    instance.kv_index.blocks.update(route.block_hashes(BLOCK)[:blocks])
    return instance


def prefill_pool(*queued_tokens: int) -> InstancePool:
    pool = InstancePool.of([f"http://127.0.0.1:{2 + i}" for i in range(len(queued_tokens))], "prefill", "round_robin")
    for instance, queued in zip(pool.instances, queued_tokens):
        instance.outstanding_tokens = queued
    return pool


def test_d_computes_what_it_lacks_up_to_the_threshold_and_p_the_rest() -> None:
    route = Route("k", tokens=list(range(100)))  # 25 blocks of 4
    pool = prefill_pool(0)
    for held, expected in [(25, LOCAL), (24, LOCAL), (23, LOCAL), (22, DISAGGREGATED), (0, DISAGGREGATED)]:
        # lacking: 0, 4, 8, 12, 100 tokens against a threshold of 8
        assert choose_path(route, decode_holding(route, held), pool, "conditional", 8) == expected, held
    assert choose_path(route, decode_holding(route, 25), pool, "always", 8) == DISAGGREGATED
    assert choose_path(Route("k"), decode_holding(route, 25), pool, "conditional", 8) == DISAGGREGATED  # tokens unknown
    assert choose_path(Route("k", tokens=[1, 2]), Instance("http://127.0.0.1:1", "decode"), pool, "conditional",
                       8) == LOCAL  # no events followed: a short prompt still


def test_a_queue_on_every_p_longer_than_what_d_lacks_keeps_the_request_on_d() -> None:
    route = Route("k", tokens=list(range(100)))
    decode = decode_holding(route, 0)  # lacks all 100
    assert choose_path(route, decode, prefill_pool(101, 500), "conditional", 8) == LOCAL
    assert choose_path(route, decode, prefill_pool(101, 100), "conditional", 8) == DISAGGREGATED  # one P has room
    pool = prefill_pool(0, 0)
    for instance in pool.instances:
        instance.mark_failed("gone")  # breakers open
    assert choose_path(route, decode, pool, "conditional", 8) == LOCAL


@pytest.mark.parametrize(("flags", "message"), [(["--disagg-policy", "sometimes"], "invalid choice"),
                                                (["--local-prefill-max-tokens", "-1"], "must not be negative"),
                                                (["--reuse-min-tokens", "-1"], "must not be negative")])
def test_bad_flags_are_refused(flags, message, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    with pytest.raises(SystemExit) as exc:
        proxy_config(parser.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *flags]))
    assert message in f"{exc.value} {capsys.readouterr().err}"


def test_the_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    config = proxy_config(parser.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                                             "--disagg-policy", "conditional", "--local-prefill-max-tokens", "64",
                                             "--reuse-min-tokens", "32"]))
    assert (config.disagg_policy, config.local_prefill_max_tokens, config.reuse_min_tokens) == ("conditional", 64, 32)
    assert config.needs_tokens and config.follows_events("decode") and not config.follows_events("prefill")
    assert ProxyConfig(("a",), ("b",), disagg_policy="conditional", policy="kv_aware").follows_events("prefill")
    assert not ProxyConfig(("a",), ("b",)).needs_tokens


def test_conditional_routes_decode_by_what_the_servers_hold_unless_told_otherwise() -> None:
    """The next turn is prefilled on D only where D holds the last one: under conditional
    the decode side defaults to kv_aware (it was --policy's round robin)."""
    conditional = ProxyConfig(("a",), ("b",), disagg_policy="conditional")
    assert (conditional.role_policy("decode"), conditional.role_policy("prefill")) == ("kv_aware", "round_robin")
    told = ProxyConfig(("a",), ("b",), disagg_policy="conditional", decode_policy="least_loaded")
    assert told.role_policy("decode") == "least_loaded"
    assert ProxyConfig(("a",), ("b",), policy="prefix_aware").role_policy("decode") == "prefix_aware"
    assert conditional.decode_policy is None  # what was asked stays as asked


@pytest.mark.slow
def test_a_short_prompt_goes_to_d_as_it_is_and_a_long_one_through_p() -> None:
    with fake("prefill") as p, fake("decode") as d, proxy_in_front(
            [p.url], [d.url], disagg_policy="conditional", local_prefill_max_tokens=8) as proxy:
        for prompt, stream in [("short", False), ("eight ch", True)]:  # fake tokens: a character each
            response = http_client().post(f"{proxy}/v1/completions", timeout=30,
                                          json={"prompt": prompt, "max_tokens": 2, "stream": stream})
            assert response.status_code == 200 and response.headers["x-pd-path"] == LOCAL, response.text
        assert p.received == [] and [r.body for r in d.received] == [
            {"prompt": "short", "max_tokens": 2, "stream": False},  # no kv_transfer_params: D prefills it
            {"prompt": "eight ch", "max_tokens": 2, "stream": True,
             "return_token_ids": True}]  # a stream the proxy may resume elsewhere: it reads its token ids
        response = http_client().post(f"{proxy}/v1/completions", json={"prompt": "nine char", "max_tokens": 2},
                                      timeout=30)
        assert response.status_code == 200 and response.headers["x-pd-path"] == DISAGGREGATED
        assert len(p.received) == 1 and d.received[-1].body["kv_transfer_params"]["remote_request_id"] == "p-1"
        assert proxy_metric(proxy, 'pd_proxy_requests_by_path_total{path="local"}') == 2
        assert proxy_metric(proxy, 'pd_proxy_requests_by_path_total{path="disaggregated"}') == 1


@pytest.mark.slow
def test_without_a_p_to_take_it_d_prefills_the_request_instead_of_a_503() -> None:
    with refusing_port() as gone, fake("decode") as d, proxy_in_front(
            [gone], [d.url], disagg_policy="conditional", local_prefill_max_tokens=0) as proxy:
        for _ in range(2):  # P's breaker closed (tried, unreachable), then open (not tried)
            response = http_client().post(f"{proxy}/v1/completions", json={"prompt": "x" * 50, "max_tokens": 2},
                                          timeout=30)
            assert response.status_code == 200 and response.headers["x-pd-path"] == LOCAL, response.text
        assert not proxy_health(proxy)[gone]["healthy"]
        assert http_client().get(f"{proxy}/health", timeout=5).status_code == 200  # D serves alone
        assert [r.body.get("kv_transfer_params") for r in d.received] == [None, None]
    with refusing_port() as gone, fake("decode") as d, proxy_in_front([gone], [d.url]) as proxy:  # always
        response = http_client().post(f"{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert response.status_code == 503 and "no healthy prefill instance" in response.json()["error"]["message"]
        assert d.received == []


def test_p_reads_from_d_the_full_blocks_d_holds_beyond_any_p_when_they_are_enough() -> None:
    route = Route("k", tokens=list(range(41)))  # 10 full blocks of 4, and one token
    decode, pool = decode_holding(route, 11), prefill_pool(0, 0)
    assert reuse_tokens(route, decode, pool, 8) == 40  # all but the last token's block
    assert choose_path(route, decode_holding(route, 4), pool, "conditional", 8, 16) == REUSE
    assert choose_path(route, decode_holding(route, 4), pool, "conditional", 8, 17) == DISAGGREGATED
    assert choose_path(route, decode_holding(route, 4), pool, "conditional", 8, 0) == DISAGGREGATED  # off
    assert choose_path(route, decode_holding(route, 4), pool, "always", 8, 16) == DISAGGREGATED
    pool.instances[1].kv_index, pool.instances[1].block_size = KVIndex(), BLOCK
    pool.instances[1].kv_index.blocks.update(route.block_hashes(BLOCK)[:3])  # a P holds 12 of D's 16
    assert reuse_tokens(route, decode_holding(route, 4), pool, 8) == 0
    assert reuse_tokens(route, decode_holding(route, 5), pool, 8) == 20
    pool.instances[1].mark_failed("gone")  # what an unhealthy P holds does not count
    assert reuse_tokens(route, decode_holding(route, 4), pool, 8) == 16


def prefill_reusing_once(p: FakeServer, d: FakeServer) -> tuple[object, ProxyMetrics]:
    """`prefill_reusing` of a 9-token prompt whose first 8 tokens D is to export."""
    async def run():
        upstream = Upstream(ProxyConfig((p.url,), (d.url,), disagg_policy="conditional"))
        async with httpx.AsyncClient() as upstream.client:
            call = Call("/v1/completions", {"prompt": "123456789", "max_tokens": 2}, {"X-Request-Id": "r"},
                        Route("k", tokens=fake_tokens("123456789")), "r")
            return await prefill_reusing(upstream, call, upstream.decode.instances[0], 8), upstream.metrics
    return asyncio.run(run())


def exported(n: int) -> Reply:
    return Reply(body=COMPLETION | {"kv_transfer_params": FakeServer.params(n) | {"num_prompt_tokens": 8}})


@pytest.mark.slow
def test_p_gets_the_prefix_d_exported_and_the_request_goes_on_without_it_when_either_balks() -> None:
    refused = Reply(403, {"error": {"message": "no", "type": "permission_error", "param": "kv_transfer_params.prefix",
                                    "code": "kv_transfer_params_refused"}})
    with fake("prefill") as p, fake("decode") as d:
        d.replies = [exported(1)]
        answer, metrics = prefill_reusing_once(p, d)
        assert isinstance(answer, Prefilled) and answer.reused and d.releases == []
        assert d.received[0].body == {"prompt": fake_tokens("12345678"), "max_tokens": 1, "temperature": 0,
                                      "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        assert d.received[0].headers["x-request-id"] == "r-export"
        assert p.received[0].body["kv_transfer_params"] == {"do_remote_decode": True,
                                                            "prefix": exported(1).body["kv_transfer_params"]}
        d.replies = [Reply()]  # a completion with no parameters: nothing exported
        answer, metrics = prefill_reusing_once(p, d)
        assert isinstance(answer, Prefilled) and not answer.reused
        assert p.received[-1].body["kv_transfer_params"] == {"do_remote_decode": True}
        assert metrics.reuse_fallbacks.labels(reason="export")._value.get() == 1
        d.replies, p.replies = [exported(3)], [refused]  # P refuses the prefix: released, and P asked without
        answer, metrics = prefill_reusing_once(p, d)
        assert isinstance(answer, Prefilled) and not answer.reused and d.released_ids == ["p-3"]
        assert [r.body["kv_transfer_params"] for r in p.received[-2:]] == [
            {"do_remote_decode": True, "prefix": exported(3).body["kv_transfer_params"]}, {"do_remote_decode": True}]
        assert metrics.reuse_fallbacks.labels(reason="refused")._value.get() == 1
        d.replies, p.replies = [exported(5)], [Reply(500, {"error": {"message": "boom", "code": "internal"}})]
        answer, _ = prefill_reusing_once(p, d)  # P failed the request: D's export is released
        assert isinstance(answer, Response) and answer.status_code == 500 and d.released_ids == ["p-3", "p-5"]
