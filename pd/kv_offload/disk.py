"""The disk tier's bytes: one file of fixed-size slots, moved to and from the KV cache by
NIXL's POSIX backend (asynchronous; progressed when polled, once per engine step).

A slot holds one block of one KV cache group: the group's byte ranges of that block
(`CanonicalKVCaches.block_ranges`) back to back. Each written slot has a CRC-32 of its
bytes; a load whose bytes do not match is a failed load (the block is dropped), never
KV. In the tier's directory: `pd-kv.blocks` (the slots), `pd-kv.lock` (held by the one
server using the directory; a second one runs without a tier), and `pd-kv.index`, a
snapshot of which block each slot holds (and its CRC), written atomically (a temporary
file renamed) every `SNAPSHOT_SECONDS` (or, for a tier whose snapshot takes long, less
often: at most 2 % of the engine's time) while something changed and at shutdown: a server
restarted on the same path with the same compatibility hash starts with those blocks;
another hash, another slot size or an unreadable snapshot starts empty, with a log line.
The file is sparse: its space is taken as slots are first written. NIXL's POSIX backend
moves host memory: a GPU engine's blocks go through host rows (staging.py).

Any error of the file or of a transfer (disk full, a read-only file system, the file
deleted underneath) turns the tier off with a warning: its loads fail (the requests
compute instead), its stores end unstored, and it holds nothing from then on.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_offload.index import Key
from pd.kv_offload.staging import Staging
from pd.kv_offload.tier import COUNTERS, Finished, TierBlock, slot_bytes

logger = logging.getLogger(__name__)

SNAPSHOT_SECONDS = 5.0
SNAPSHOT_SHARE = 50  # a snapshot taking t seconds is written at most every 50 t
MAX_DEFAULT_BYTES = 64 << 30
SNAPSHOT_VERSION = 1


class SlotEntry(msgspec.Struct, array_like=True, frozen=True):
    slot: int
    block_hash: bytes
    group: int
    crc: int


class Snapshot(msgspec.Struct, frozen=True):
    version: int
    compat_hash: str
    slot_bytes: int
    num_slots: int
    entries: list[SlotEntry]  # least recently used first


@dataclass
class _Transfer:
    handle: object
    blocks: list[TierBlock]
    rows: list[int | None]  # each block's staging row (None: moved from the KV cache itself)
    crcs: list[int] = field(default_factory=list)  # stores: of the bytes written
    request_id: str | None = None  # loads: whose blocks these are
    started: float = field(default_factory=time.perf_counter)


def default_disk_bytes(directory: Path) -> int:
    """A tenth of the free space where the tier's file goes, at most `MAX_DEFAULT_BYTES`."""
    return min(MAX_DEFAULT_BYTES, shutil.disk_usage(_existing(directory)).free // 10)


def _existing(directory: Path) -> Path:
    """`directory`, or its nearest ancestor that exists."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


class DiskTier:
    name = "disk"

    def __init__(self, directory: Path, nbytes: int | None, caches: CanonicalKVCaches, compat_hash: str,
                 agent_name: str, staged: bool | None = None) -> None:
        """`nbytes`: the tier's size (None: `default_disk_bytes`; where that is not one
        block, the tier is off). `staged`: move blocks through host rows (`Staging`); None:
        where the KV cache is not in host memory (a GPU engine's)."""
        self.caches = caches
        self.slot_bytes = slot_bytes(caches)
        if nbytes is not None and nbytes < self.slot_bytes:
            raise ValueError(f"--kv-offload-disk-bytes {nbytes} is less than one block ({self.slot_bytes} bytes)")
        self.num_slots = (nbytes or 0) // self.slot_bytes
        self.compat_hash = compat_hash
        self.directory = Path(directory)
        self.data_path, self.index_path = self.directory / "pd-kv.blocks", self.directory / "pd-kv.index"
        self.off_reason: str | None = None
        self.entries: OrderedDict[int, SlotEntry] = OrderedDict()  # slot -> what it holds
        self.transfers: list[_Transfer] = []
        self.dirty, self.next_check = False, time.monotonic() + SNAPSHOT_SECONDS
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._ended = Finished()  # since the last poll
        self.fd: int | None = None
        self.lock_fd: int | None = None
        self.agent = None
        self.staging = None
        try:
            if nbytes is None:
                self.num_slots = self._default_slots()
            if staged or (staged is None and caches.tensors[0].device.type != "cpu"):
                self.staging = Staging(caches, self.slot_bytes)
            self._open(Path(directory))
            self._start_nixl(agent_name)
        except Exception as exc:  # serving goes on without the tier
            self.turn_off(f"cannot use {directory}: {type(exc).__name__}: {exc}")
            return
        self.restored_count = len(self.entries)

    def _default_slots(self) -> int:
        """The slots of the default size; OSError saying why the directory cannot take one."""
        existing = _existing(self.directory)
        if not os.access(existing, os.W_OK):
            raise OSError(f"{existing} is not writable (a read-only file system, or no permission)")
        nbytes = default_disk_bytes(self.directory)
        if nbytes < self.slot_bytes:
            raise OSError(f"the default size, a tenth of the {nbytes * 10} bytes free there, is less than one block "
                          f"({self.slot_bytes} bytes); give --kv-offload-disk-bytes")
        return nbytes // self.slot_bytes

    def description(self) -> str:
        if self.off_reason is not None:
            return f"KV disk tier off: {self.off_reason}"
        return (f"KV disk tier {self.data_path}: {self.num_slots} blocks of {self.slot_bytes} bytes "
                f"({self.num_slots * self.slot_bytes / 2**30:.2f} GiB), {self.restored_count} restored from before")

    def _open(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.lock_fd = os.open(directory / "pd-kv.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError("another server's disk tier uses this directory") from None
        restored = self._read_snapshot()
        flags = os.O_RDWR | os.O_CREAT | (0 if restored else os.O_TRUNC)
        self.fd = os.open(self.data_path, flags, 0o600)
        os.ftruncate(self.fd, self.num_slots * self.slot_bytes)  # sparse: space is taken as slots are written
        self.entries = OrderedDict((e.slot, e) for e in restored)
        self._write_snapshot()  # the path must be writable now, not at the first snapshot

    def _read_snapshot(self) -> list[SlotEntry]:
        """The entries a previous server left, if it wrote them under this compatibility hash."""
        if not self.index_path.exists():
            return []
        try:
            snap = msgspec.msgpack.decode(self.index_path.read_bytes(), type=Snapshot)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("KV disk tier: %s is unreadable (%s); starting empty", self.index_path, exc)
            return []
        if (snap.version, snap.compat_hash, snap.slot_bytes) != (SNAPSHOT_VERSION, self.compat_hash, self.slot_bytes):
            logger.warning("KV disk tier: %s was written under another compatibility hash or layout (%s, %d-byte "
                           "slots); starting empty", self.index_path, snap.compat_hash[:16], snap.slot_bytes)
            return []
        if not self.data_path.exists():
            logger.warning("KV disk tier: %s is missing; starting empty", self.data_path)
            return []
        return [e for e in snap.entries if 0 <= e.slot < self.num_slots]

    def _start_nixl(self, agent_name: str) -> None:
        from pd.kv_transfer.nixl_api import load_nixl

        api, _ = load_nixl()
        self.agent = api.nixl_agent(agent_name, api.nixl_agent_config(enable_prog_thread=False, backends=["POSIX"]))
        self.agent_name = agent_name
        host = [self.staging.buffer] if self.staging is not None else [t.tensor for t in self.caches.tensors]
        self.memory = [self.agent.register_memory(t) for t in host]
        self.file = self.agent.register_memory([(0, self.num_slots * self.slot_bytes, self.fd, "")], "FILE")

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    @property
    def restored(self) -> list[tuple[Key, int]]:
        """(key, slot) of the blocks the tier holds at start, least recently used first."""
        return [((e.block_hash, e.group), e.slot) for e in self.entries.values()]

    # --- transfers ---
    def store(self, blocks: list[TierBlock]) -> None:
        """Write these blocks (their bytes must not change until `poll` reports them)."""
        if not blocks:
            return
        rows = self._rows(blocks) if self.off_reason is None else None
        if rows is None:  # off, or no room to stage them: not stored
            self._ended.store_failed += [(b.block_hash, b.group) for b in blocks]
            self.counters["store_failures"] += len(blocks)
            return
        if self.staging is not None:
            self.staging.to_host(blocks, rows)
        self._post("WRITE", blocks, rows, crcs=[self._crc(b, r) for b, r in zip(blocks, rows)])

    def load(self, request_id: str, blocks: list[TierBlock]) -> None:
        """Read these slots into the request's blocks; `poll` reports the request loaded or failed."""
        rows = self._rows(blocks) if self.off_reason is None else None
        if rows is None:
            why = f"is off: {self.off_reason}" if self.off_reason is not None else "has no room to stage them"
            self._ended.load_failed[request_id] = f"the KV disk tier {why}"
            self.counters["load_failures"] += 1
            return
        self._post("READ", blocks, rows, request_id=request_id)

    def _rows(self, blocks: list[TierBlock]) -> list[int | None] | None:
        """Each block's staging row (None for all without staging); None when too few are free."""
        return [None] * len(blocks) if self.staging is None else self.staging.take(len(blocks))

    def _host_ranges(self, block: TierBlock, row: int | None) -> list[tuple[int, int]]:
        """Where the block's bytes are in host memory: its KV cache ranges, or its staging row."""
        if row is None:
            return self.caches.block_ranges(block.group, [block.block_id])
        return self.staging.ranges(block, row)

    def _post(self, op: str, blocks: list[TierBlock], rows: list[int | None], crcs: list[int] | None = None,
              request_id: str | None = None) -> None:
        memory, file = [], []
        for block, row in zip(blocks, rows):
            offset = block.slot * self.slot_bytes
            for addr, length in self._host_ranges(block, row):
                memory.append((addr, length, 0))
                file.append((offset, length, self.fd))
                offset += length
        transfer = _Transfer(None, blocks, rows, crcs or [], request_id)
        try:
            transfer.handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(memory, "DRAM"),
                                                         self.agent.get_xfer_descs(file, "FILE"), self.agent_name)
            self.transfers.append(transfer)
            self.agent.transfer(transfer.handle)
        except Exception as exc:
            if transfer not in self.transfers:
                self._end(transfer, ok=False)
            self.turn_off(f"a {op.lower()} could not be posted: {type(exc).__name__}: {exc}")

    def _crc(self, block: TierBlock, row: int | None) -> int:
        crc = 0
        for addr, length in self._host_ranges(block, row):
            crc = zlib.crc32((ctypes.c_char * length).from_address(addr), crc)
        return crc

    def poll(self) -> Finished:
        """Progress the transfers; what ended since the last call."""
        pending, self.transfers = self.transfers, []
        for i, transfer in enumerate(pending):
            state = self._state(transfer)
            if state == "PROC":
                self.transfers.append(transfer)
                continue
            self._release(transfer)
            self._end(transfer, ok=state == "DONE")
            if state != "DONE":
                self.transfers += pending[i + 1:]
                self.turn_off(f"a transfer ended {state}")
                break
        self._check_file()
        ended, self._ended = self._ended, Finished()
        return ended

    def _state(self, transfer: _Transfer) -> str:
        try:
            return self.agent.check_xfer_state(transfer.handle)
        except Exception as exc:  # NIXL raises for a failed transfer
            return f"ERR ({type(exc).__name__}: {exc})"

    def _end(self, transfer: _Transfer, ok: bool) -> None:
        try:
            self._end_transfer(transfer, ok)
        finally:
            if self.staging is not None:
                self.staging.give(transfer.rows)

    def _end_transfer(self, transfer: _Transfer, ok: bool) -> None:
        if transfer.request_id is None:
            self._end_store(transfer, ok)
        elif not ok:
            self._ended.load_failed[transfer.request_id] = "reading the KV disk tier failed"
            self.counters["load_failures"] += 1
        else:
            self._end_load(transfer)

    def _end_store(self, transfer: _Transfer, ok: bool) -> None:
        done = self._ended
        for block, crc in zip(transfer.blocks, transfer.crcs):
            key = (block.block_hash, block.group)
            if not ok:
                done.store_failed.append(key)
                self.counters["store_failures"] += 1
                continue
            self.entries[block.slot] = SlotEntry(block.slot, block.block_hash, block.group, crc)
            self.entries.move_to_end(block.slot)
            done.stored.append(key)
            self.counters["stored_blocks"] += 1
            self.counters["stored_bytes"] += self.slot_bytes
        self.dirty = True

    def _end_load(self, transfer: _Transfer) -> None:
        done = self._ended
        bad = [b for b, row in zip(transfer.blocks, transfer.rows) if not self._matches(b, row)]
        if bad:
            for block in bad:
                self.entries.pop(block.slot, None)
                done.corrupt.append((block.block_hash, block.group))
            self.counters["corrupt_blocks"] += len(bad)
            self.counters["load_failures"] += 1
            self.dirty = True
            done.load_failed[transfer.request_id] = f"{len(bad)} block(s) of the KV disk tier failed their checksum"
            logger.warning("KV disk tier: %d block(s) failed their checksum and were dropped", len(bad))
            return
        if self.staging is not None:
            self.staging.to_device(transfer.blocks, transfer.rows)
        for block in transfer.blocks:
            self.entries.move_to_end(block.slot)
        done.loaded.append(transfer.request_id)
        done.load_seconds.append(time.perf_counter() - transfer.started)
        self.counters["loaded_blocks"] += len(transfer.blocks)
        self.counters["loaded_bytes"] += len(transfer.blocks) * self.slot_bytes

    def _matches(self, block: TierBlock, row: int | None) -> bool:
        entry = self.entries.get(block.slot)
        return (entry is not None and (entry.block_hash, entry.group) == (block.block_hash, block.group)
                and entry.crc == self._crc(block, row))

    def _release(self, transfer: _Transfer) -> None:
        try:
            self.agent.release_xfer_handle(transfer.handle)
        except Exception:  # a handle NIXL already dropped; nothing to free
            logger.debug("releasing a disk tier transfer handle failed", exc_info=True)

    # --- the file ---
    def _check_file(self) -> None:
        """The file still linked, and the snapshot written when due: every
        `SNAPSHOT_SECONDS`, or less often for a tier so large that writing its snapshot
        would take more than 1/`SNAPSHOT_SHARE` of the engine's time (it runs in the step)."""
        now = time.monotonic()
        if self.off_reason is not None or now < self.next_check:
            return
        try:
            if os.fstat(self.fd).st_nlink == 0:
                raise FileNotFoundError(f"{self.data_path} was deleted")
            if self.dirty:
                self._write_snapshot()
        except OSError as exc:
            self.turn_off(f"{type(exc).__name__}: {exc}")
        self.next_check = now + max(SNAPSHOT_SECONDS, SNAPSHOT_SHARE * (time.monotonic() - now))

    def _write_snapshot(self) -> None:
        snap = Snapshot(SNAPSHOT_VERSION, self.compat_hash, self.slot_bytes, self.num_slots,
                        list(self.entries.values()))
        tmp = self.index_path.with_suffix(".index.tmp")
        tmp.write_bytes(msgspec.msgpack.encode(snap))
        os.replace(tmp, self.index_path)
        self.dirty = False

    def turn_off(self, reason: str) -> None:
        """Stop using the disk: transfers under way end failed (reported by the next
        `poll`), and nothing is stored or loaded from now on."""
        if self.off_reason is not None:
            return
        self.off_reason = reason
        logger.warning("KV disk tier turned off, serving goes on without it: %s", reason)
        for transfer in self.transfers:
            self._release(transfer)
            self._end(transfer, ok=False)
        self.transfers = []
        self.entries.clear()
        self._close()

    def _close(self) -> None:
        for name in ("fd", "lock_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    logger.debug("closing the KV disk tier's %s failed", name, exc_info=True)
                setattr(self, name, None)

    def shutdown(self) -> None:
        """Let stores under way land, write the snapshot (a restart reuses the blocks),
        close the file."""
        if self.off_reason is None and self.fd is not None:
            deadline = time.monotonic() + 10.0
            while self.transfers and time.monotonic() < deadline:
                self.poll()
                time.sleep(0.001)
            try:
                self._write_snapshot()
            except OSError as exc:
                logger.warning("KV disk tier: the snapshot could not be written at shutdown: %s", exc)
        self._close()
