"""A tier server's KV events name the medium: blocks written to disk are published as
stored on "disk" beside their "device" events, evicted from the device they stay on
disk, and a replay's snapshot holds both."""

from __future__ import annotations

import random

import zmq

from kv_events.messages import BlockRemoved, BlockStored, EventBatch, ReplayRequest, encode, replay_reply_decoder
from launch import free_port
from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from tests.support.pd_client import complete
from tests.support.server_harness import running_server


def replay(port: int, start: int) -> list:
    """Every batch the server still keeps from `start` on, or its snapshot."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(encode(ReplayRequest(start)))
        assert dealer.poll(30_000), "no replay reply"
        return replay_reply_decoder.decode(dealer.recv()).batches
    finally:
        context.destroy(linger=0)


def held(batches: list, medium: str) -> set[bytes]:
    blocks: set[bytes] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == medium:
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == medium:
                blocks.difference_update(event.block_hashes)
    return blocks


def test_blocks_on_disk_are_published_with_their_medium_and_outlive_their_eviction(tiny_models, tmp_path):
    events, replay_port = free_port(), free_port()
    rng = random.Random(0)
    with running_server(tiny_models["qwen3"], tmp_path / "s.log", "--max-model-len", "512", "--kv-cache-memory",
                        "2400000", "--kv-offload-disk-path", str(tmp_path / "tier"), "--kv-events-port", str(events),
                        "--kv-events-replay-port", str(replay_port)) as server:
        for _ in range(6):  # 6 x 12 full blocks: more than the 35 the cache holds
            complete(server, {"prompt": [rng.randrange(5, 200) for _ in range(200)], "max_tokens": 2})
        batches = replay(replay_port, 1)
        on_disk, on_device = held(batches, "disk"), held(batches, "device")
        assert len(on_disk) == 6 * 12 and len(on_device) <= 35
        assert any(isinstance(e, BlockRemoved) and e.medium == "device" for b in batches for e in b.events)


def test_a_replay_snapshot_holds_the_blocks_of_the_device_and_of_the_disk(tiny_models, tmp_path):
    rng = random.Random(1)
    with LLM(str(tiny_models["qwen3"]), max_model_len=512, num_threads=1, kv_cache_memory=2_400_000,
             kv_offload_disk_path=tmp_path, kv_events_port=free_port()) as llm:
        for _ in range(4):
            llm.generate([[rng.randrange(5, 200) for _ in range(200)]], SamplingParams(max_tokens=2))
        snapshot = [EventBatch("e", 1, llm.engine.kv_events.snapshot(), snapshot=True)]
        assert len(held(snapshot, "disk")) == 4 * 12
        assert held(snapshot, "device") == set(llm.engine.kv_cache_manager.pool.cached_events()[0].block_hashes)
