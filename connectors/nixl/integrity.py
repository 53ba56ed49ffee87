"""The NIXL worker's part in `--kv-digest` (pd/kv_transfer/digests.py): digesting what its
engine holds for readers, checking what it read, and a test hook that breaks the latter.

- Holder: in the step that computes the last of a held request's prompt (the scheduler
  half names it: `reqs_to_digest`), each rank digests its own heads of the request's
  blocks once the step ran; rank 0 keeps them in the `DigestBook` the scheduler half
  signs into the parameters, a rank > 0 reports them in its output.
- Reader: a read whose parameters carry digests has every unit each rank read, from
  whichever of the holder's ranks, checked against the holder rank's digests.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from connectors.nixl.digest_book import DigestBook
from connectors.nixl.scheduler import ReqToRecv
from pd.contracts.connector_api import KVConnectorOutput
from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_transfer.digests import BlockDigests, mismatch

PERTURB_ENV = "PD_TEST_PERTURB_LANDED_KV"  # tests: "1" garbles each read's first block after its checks
UnitsRead = list[tuple[int, list[set]]]  # (the holder's rank read from, the unit keys read of each group)


class Integrity:
    def __init__(self, kv_caches: CanonicalKVCaches, book: DigestBook | None) -> None:
        self.kv_caches = kv_caches
        self.digests = BlockDigests(kv_caches)
        self.book = book  # rank 0 of a holder with --kv-digest
        self.perturb = os.environ.get(PERTURB_ENV) == "1"  # a deliberately broken decode server (tests)

    def digest_held(self, to_digest: list[tuple[str, list[list[int]]]], output: KVConnectorOutput) -> None:
        """The digests of the prompts the step just computed: kept (rank 0) or reported."""
        for req_id, block_ids in to_digest:
            digests = self.digests.request(block_ids)
            if self.book is not None:
                self.book.put(req_id, 0, digests)
            else:
                output.digests[req_id] = digests

    def mismatch(self, recv: ReqToRecv, units_read: UnitsRead, peer_units: Callable[[int], list[set]]) -> str | None:
        """Why what this rank read for `recv` differs from the holder's digests (None: it
        matches, or the holder gave none). `peer_units(rank)`: that holder rank's unit keys."""
        blobs = recv.remote.kv_digests
        if blobs is None:
            return None
        for rank, keys in units_read:
            why = mismatch(self.digests, recv.local_block_ids, recv.remote_block_ids, keys, blobs[rank],
                           peer_units(rank))
            if why is not None:
                return why
        return None

    def garble(self, recv: ReqToRecv) -> None:
        """The test hook, where it is on: the first block the read landed garbled (its
        every byte flipped in one bit) after every check, as a broken decode server would:
        its answers then differ from a colocated server's (what the proxy's canary catches)."""
        if not self.perturb:
            return
        for group, ids in enumerate(recv.local_block_ids):
            block = next((b for b in ids if b), 0)
            if block:
                for ref in self.kv_caches.group_data_refs[group]:
                    rows = self.kv_caches.tensors[ref.tensor_idx].tensor
                    rows[block, ref.offset_bytes:ref.offset_bytes + ref.page_size_bytes] ^= 0x40
                return
