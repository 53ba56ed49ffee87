"""NIXL worker halves in one process, over UCX on 127.0.0.1, with a clock a test moves."""

from __future__ import annotations

import dataclasses
import time

from connectors.nixl.scheduler import ReqToRecv
from connectors.nixl.worker import NixlConnectorWorker, NixlWorkerConfig
from pd.kv_cache.allocation import allocate_kv_caches
from pd.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from pd.kv_transfer.connector_config import TransferSettings
from pd.kv_transfer.params import RemotePrefillParams

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32")  # 256-byte pages
CONFIG = KVCacheConfig(num_blocks=32, groups=(KVCacheGroup(SPEC, ("a", "b")), KVCacheGroup(SPEC, ("c", "d"))))


def remote_prefill(engine_id: str, host: str, port: int, request_id: str, lease_expires_at: float | None = None,
                   lease_slot: int | None = None, lease_token: int | None = None) -> RemotePrefillParams:
    """PD parameters naming where P holds a request's KV (the worker half reads only
    these fields of them; the blocks it reads come with `ReqToRecv`)."""
    return RemotePrefillParams(True, engine_id, host, port, request_id, [[0]], 1, [0], 1,
                               lease_expires_at=lease_expires_at, lease_slot=lease_slot, lease_token=lease_token)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_worker(engine_id: str, compat: str = "h", clock=None, wall_clock=time.time, **settings):
    """A worker on a KV cache of its own; `settings`: the worker config's (handshake_timeout_s,
    ...) and the rest transfer settings (digest, lease_seconds, ...)."""
    alloc = allocate_kv_caches(CONFIG, "cpu", "canonical")
    own = {f.name for f in dataclasses.fields(NixlWorkerConfig)}
    transfer = TransferSettings(**{k: v for k, v in settings.items() if k not in own}).connector_config()
    worker = NixlConnectorWorker(NixlWorkerConfig(engine_id, compat, transfer, clock=clock or time.monotonic,
                                                  wall_clock=wall_clock,
                                                  **{k: v for k, v in settings.items() if k in own}))
    worker.register_kv_caches(alloc.describe())
    return worker, alloc.buffers[0]


class Poller:
    """Polls every worker like an engine step does (without progress threads a transfer
    moves only while both agents are polled) and accumulates what each reported."""

    def __init__(self, *workers, as_engines: bool = False) -> None:
        self.workers = workers
        self.as_engines = as_engines  # poll a worker only while it wants polling, as its engine's loop does
        self.sent = {w.config.engine_id: set() for w in workers}
        self.recved = {w.config.engine_id: set() for w in workers}
        self.failed = {w.config.engine_id: set() for w in workers}
        self.unverified = {w.config.engine_id: set() for w in workers}

    def until(self, predicate, deadline_s: float = 10.0) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            for w in self.workers:
                if self.as_engines and not w.wants_polling:
                    continue
                out = w.get_finished(set())
                name = w.config.engine_id
                self.sent[name] |= out.finished_sending
                self.recved[name] |= out.finished_recving
                self.failed[name] |= out.failed_recving.keys()
                self.unverified[name] |= out.unverified
            if predicate(self):
                return
            time.sleep(0.002)
        raise AssertionError(f"condition not met in {deadline_s}s: sent={self.sent} "
                             f"recved={self.recved} failed={self.failed}")


def recv(p, local, remote, lease=None) -> ReqToRecv:
    return ReqToRecv("d1", remote_prefill("P", "127.0.0.1", p.side_channel_port, "p1", lease), local, remote)
