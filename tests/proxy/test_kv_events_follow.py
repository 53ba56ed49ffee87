"""The proxy following a server's KV events, from a fake server whose events the test
publishes itself: it asks for a replay as it starts (a proxy started late catches up),
follows the batches, asks again at a gap, drops and counts what is not an event, and
routes by what it learned (the X-PD-Prefill header names the overlap expected)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq

from kv_events.hashing import HASH_NAME, extend_block_hashes
from kv_events.messages import BlockStored, EventBatch, ReplayReply, encode, replay_request_decoder
from launch import free_port, http_client
from proxy.instances import Instance
from proxy.kv_subscriber import _learn
from tests.support.proxy_fakes import fake, fake_tokens, proxy_health, proxy_in_front, proxy_metric, wait_until

BLOCK = 4
PROMPT = "The lighthouse keeper counted ships, every night of the year."



@pytest.fixture
def publisher():
    context = zmq.Context()
    pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    pub_url, router_url = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub.bind(pub_url)
    router.bind(router_url)
    yield pub, router, {"publisher": pub_url, "replay": router_url}
    pub.close(linger=0)
    router.close(linger=0)
    context.term()


def replay_asked(router) -> tuple[list[bytes], int]:
    assert router.poll(10_000), "no replay request"
    frames = router.recv_multipart()
    return frames[:-1], replay_request_decoder.decode(frames[-1]).start_seq


def blocks(proxy: str, url: str) -> int:
    return (proxy_health(proxy)[url]["kv_index"] or {}).get("blocks", -1)


def test_a_servers_events_are_followed_through_replays_gaps_and_garbage(publisher) -> None:
    pub, router, endpoints = publisher
    hashes = extend_block_hashes([], fake_tokens(PROMPT), BLOCK)
    config = {"engine_id": "e1", "hash": HASH_NAME, "groups": [{"id": 0, "kind": "full_attention",
                                                               "block_size": BLOCK}], "routing_group": 0}
    with fake("prefill") as p, fake("decode") as d:
        p.kv_config, d.kv_config = config | {"events": endpoints}, config | {"events": None}
        with proxy_in_front([p.url], [d.url], policy="kv_aware") as proxy:
            envelope, start = replay_asked(router)  # started late: everything from the start
            assert start == 1
            snapshot = EventBatch("e1", 3, [BlockStored(hashes[:4], None, 16, 0)], snapshot=True)
            router.send_multipart([*envelope, encode(ReplayReply([snapshot]))])
            assert wait_until(lambda: blocks(proxy, p.url) == 4)
            pub.send(b"\x92not an event batch")
            pub.send(bytes.fromhex("81a1ff01"))  # a key that is not UTF-8: UnicodeDecodeError, not DecodeError
            pub.send(encode(EventBatch("e1", 4, [BlockStored(hashes[4:6], hashes[3], 8, 0, medium="tape")])))
            pub.send(encode(EventBatch("e1", 4, [BlockStored(hashes[4:6], hashes[3], 8, 0)])))
            assert wait_until(lambda: blocks(proxy, p.url) == 6)
            assert proxy_metric(proxy, f'pd_proxy_kv_events_malformed_total{{url="{p.url}"}}') == 3  # no such medium
            pub.send(encode(EventBatch("e1", 6, [BlockStored(hashes[6:8], hashes[5], 8, 0)])))  # 5 is missing
            envelope, start = replay_asked(router)
            assert start == 5
            response = http_client().post(f"{proxy}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                                          timeout=30)
            assert response.status_code == 200
            assert response.headers["x-pd-prefill"] == f"0; overlap={6 * BLOCK}"
            assert response.headers["x-pd-decode"] == "0; overlap=0"  # it publishes nothing


@pytest.mark.parametrize("kinds", [["full_attention"], ["sliding_window", "full_attention"],
                                   ["mamba", "full_attention"]])
def test_the_routing_group_and_its_block_size_are_learned_from_the_servers_kv_config(kinds) -> None:
    """Its events name the routing group's blocks (the full-attention group, beside
    sliding-window or Mamba groups in a hybrid)."""
    groups = [{"id": i, "kind": kind, "block_size": BLOCK} for i, kind in enumerate(kinds)]
    endpoints = {"publisher": "tcp://127.0.0.1:1", "replay": "tcp://127.0.0.1:1"}
    with fake("prefill") as p:
        p.kv_config = {"engine_id": "e1", "hash": HASH_NAME, "groups": groups, "routing_group": len(kinds) - 1,
                       "events": endpoints}
        instance = Instance(p.url, "prefill")

        async def learn():
            async with httpx.AsyncClient() as client:
                return await _learn(instance, client, {}, 0.1)
        assert asyncio.run(learn()) == (endpoints["publisher"], endpoints["replay"])
    assert instance.kv_index.group == len(kinds) - 1 and instance.block_size == BLOCK
