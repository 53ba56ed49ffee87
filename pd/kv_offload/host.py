"""The host tier: slots in host memory, one int8 tensor `(num_slots, slot_bytes)` (pinned
when the KV cache is on a GPU, so copies are DMA), filled and read by a copier thread of
its own, one job at a time in the order posted (torch copies release the GIL: the engine
steps meanwhile; on a GPU the thread copies on a stream of its own and waits for it).

Host memory does not corrupt what it holds the way a file can, so its blocks carry no
checksum; it holds nothing across a restart. A copy that raises turns the tier off.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_offload.index import Key
from pd.kv_offload.tier import COUNTERS, Finished, TierBlock, slot_bytes

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    blocks: list[TierBlock]
    request_id: str | None = None  # a load's request; None: a store
    started: float = field(default_factory=time.perf_counter)
    error: str | None = None


class HostTier:
    name = "host"

    def __init__(self, nbytes: int, caches: CanonicalKVCaches) -> None:
        self.caches = caches
        self.slot_bytes = slot_bytes(caches)
        self.num_slots = nbytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"--kv-offload-host-bytes {nbytes} is less than one block ({self.slot_bytes} bytes)")
        on_gpu = caches.tensors[0].device.type == "cuda"
        self.buffer = torch.empty((self.num_slots, self.slot_bytes), dtype=torch.int8, pin_memory=on_gpu)
        self.stream = torch.cuda.Stream(caches.tensors[0].device) if on_gpu else None
        self.off_reason: str | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.pending = 0  # jobs posted and not yet reported
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pd-kv-host-tier", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.pending > 0

    @property
    def restored(self) -> list[tuple[Key, int]]:
        return []

    def description(self) -> str:
        return (f"KV host tier: {self.num_slots} blocks of {self.slot_bytes} bytes "
                f"({self.num_slots * self.slot_bytes / 2**30:.2f} GiB{', pinned' if self.stream else ''})")

    def store(self, blocks: list[TierBlock]) -> None:
        if blocks:
            self._post(_Job(blocks))

    def load(self, request_id: str, blocks: list[TierBlock]) -> None:
        self._post(_Job(blocks, request_id))

    def _post(self, job: _Job) -> None:
        self.pending += 1
        if self.off_reason is not None:
            job.error = f"the KV host tier is off: {self.off_reason}"
            self._done.put(job)
            return
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._copy(job)
            except Exception as exc:  # reported to the engine's thread, which turns the tier off
                job.error = f"{type(exc).__name__}: {exc}"
            self._done.put(job)

    def _copy(self, job: _Job) -> None:
        """Each block's ranges (its group's data refs, back to back in the slot), one way."""
        loading = job.request_id is not None
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for block in job.blocks:
                offset = 0
                for ref in self.caches.group_data_refs[block.group]:
                    start, size = ref.offset_bytes, ref.page_size_bytes
                    device = self.caches.tensors[ref.tensor_idx].tensor[block.block_id, start:start + size]
                    host = self.buffer[block.slot, offset:offset + size]
                    src, dst = (host, device) if loading else (device, host)
                    dst.copy_(src, non_blocking=self.stream is not None)
                    offset += size
        if self.stream is not None:
            self.stream.synchronize()

    def poll(self) -> Finished:
        done = Finished()
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return done
            self.pending -= 1
            self._end(job, done)

    def _end(self, job: _Job, done: Finished) -> None:
        keys = [(b.block_hash, b.group) for b in job.blocks]
        n = len(job.blocks)
        if job.error is not None and self.off_reason is None:
            self.off_reason = job.error
            logger.warning("KV host tier turned off, serving goes on without it: %s", job.error)
        if job.request_id is None:
            ok = job.error is None
            (done.stored if ok else done.store_failed).extend(keys)
            self.counters["stored_blocks" if ok else "store_failures"] += n
            self.counters["stored_bytes"] += n * self.slot_bytes if ok else 0
        elif job.error is not None:
            done.load_failed[job.request_id] = f"loading from the KV host tier failed: {job.error}"
            self.counters["load_failures"] += 1
        else:
            done.loaded.append(job.request_id)
            done.load_seconds.append(time.perf_counter() - job.started)
            self.counters["loaded_blocks"] += n
            self.counters["loaded_bytes"] += n * self.slot_bytes

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10.0)

