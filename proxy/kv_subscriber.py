"""Each server's KV events, followed into its instance's index (for `kv_aware` routing).

One task per instance, for the proxy's life: ask the server how it names blocks and
where it publishes (`GET /v1/kv_config`, again until it answers), subscribe, and ask
for a replay of everything from the index's next batch on (the kept batches, or a
snapshot): so a proxy started late, or a subscription that lost batches, catches up.
A gap in the numbers asks for a replay again; a replay not answered in time is asked
again. An event that is not one (malformed msgpack, a wrong field) is dropped and
counted; nothing received is unpickled, and nothing received stops the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx
import zmq
import zmq.asyncio

from kv_events.messages import MalformedMessage, ReplayRequest, batch_decoder, decode, encode, replay_reply_decoder
from proxy.instances import Instance
from proxy.kv_index import Applied, KVIndex

logger = logging.getLogger(__name__)

REPLAY_WAIT_S = 2.0  # a replay not answered in this long is asked for again


async def follow_kv_events(instance: Instance, client: httpx.AsyncClient, headers: dict[str, str],
                           on_malformed: Any, retry_s: float) -> None:
    """Keep `instance.kv_index` following the server's KV events (until cancelled); when
    what it held is forgotten (it failed or restarted), ask it again where it publishes."""
    while True:
        endpoints = await _learn(instance, client, headers, retry_s)
        if endpoints is None:
            return
        await _follow(instance, *endpoints, on_malformed)


async def _learn(instance: Instance, client: httpx.AsyncClient, headers: dict[str, str],
                 retry_s: float) -> tuple[str, str] | None:
    """Where the instance publishes (its index made ready to follow), or None if it does not."""
    config = None
    while config is None:
        config = await _kv_config(instance, client, headers)
        if config is None:
            await asyncio.sleep(retry_s)
    endpoints = config.get("events")
    try:
        group = int(config.get("routing_group", 0))
        block_size = int(next(g["block_size"] for g in config["groups"] if g["id"] == group))
        publisher, replay = str(endpoints["publisher"]), str(endpoints["replay"])
    except (KeyError, StopIteration, TypeError, ValueError):
        logger.warning("%s publishes no KV events (start it with --kv-events-port), or says it wrongly: "
                       "routing sees nothing in its cache", instance.url)
        return None
    instance.block_size, instance.kv_index = block_size, KVIndex(group=group)
    return publisher, replay


async def _kv_config(instance: Instance, client: httpx.AsyncClient, headers: dict[str, str]) -> dict | None:
    try:
        response = await client.get(f"{instance.url}/v1/kv_config", headers=headers, timeout=5.0)
        config = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return config if isinstance(config, dict) and isinstance(config.get("groups"), list) else None


async def _follow(instance: Instance, publisher: str, replay: str, on_malformed: Any) -> None:
    """Apply the events to the instance's index until what it held is forgotten."""
    index, epoch = instance.kv_index, instance.cache_epoch
    context = zmq.asyncio.Context.instance()
    sub, dealer = context.socket(zmq.SUB), context.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher)
        dealer.connect(replay)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        asked_at = await _ask(dealer, index)
        while instance.cache_epoch == epoch:
            ready = dict(await poller.poll(timeout=int(REPLAY_WAIT_S * 1000)))
            if dealer in ready:
                asked_at = None
                _apply_reply(index, await dealer.recv(), on_malformed)
            if sub in ready and _apply_batch(index, await sub.recv(), on_malformed) is Applied.GAP and asked_at is None:
                asked_at = await _ask(dealer, index)
            if asked_at is not None and time.monotonic() - asked_at > REPLAY_WAIT_S:
                asked_at = await _ask(dealer, index)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sub.close(linger=0)
            dealer.close(linger=0)


async def _ask(dealer: zmq.asyncio.Socket, index: KVIndex) -> float:
    await dealer.send(encode(ReplayRequest(index.last_seq + 1)))
    return time.monotonic()


def _apply_batch(index: KVIndex, raw: bytes, on_malformed: Any) -> Applied | None:
    try:
        batch = decode(batch_decoder, raw)
    except MalformedMessage:
        on_malformed()
        return None
    return index.apply(batch)


def _apply_reply(index: KVIndex, raw: bytes, on_malformed: Any) -> None:
    try:
        reply = decode(replay_reply_decoder, raw)
    except MalformedMessage:
        on_malformed()
        return
    for batch in reply.batches:
        index.apply(batch)
