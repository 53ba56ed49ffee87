"""NIXL transport: one agent per worker, READs of KV block runs from peers.

The agent is named by the engine id, runs without a progress thread (one would spin a
core at 100 %) and has every KV tensor registered once. Nothing moves unless someone
polls: `poll` progresses this side's transfers, `get_notifs` this side's incoming
traffic. Both sides must poll regularly (e.g. once per engine step, and every few ms
while idle), because:

- a connection to a peer is only established while both agents progress;
- a READ that carries a notification is reported DONE only after the notification was
  handed to the remote agent, i.e. after the *remote* side polled. The data itself lands
  without the remote's help (UCX reads it with CMA on one host), so a READ posted with
  `notif=b""` completes on this side's polling alone.

READ descriptors come from descriptors.py.

Not thread-safe: one thread (the engine's) uses a transport.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from connectors.nixl.descriptors import piece_runs, read_descriptors
from connectors.nixl.peer_messages import (
    DataRefInfo,
    DeviceKind,
    HandshakeResponse,
    KVLayoutInfo,
    PieceInfo,
    TensorInfo,
)
from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockTensor
from pd.kv_transfer.compat import COMPAT_DIFFERS
from pd.kv_transfer.digests import WHOLE
from pd.kv_transfer.nixl_api import load_nixl

logger = logging.getLogger(__name__)

XferState = Literal["PROC", "DONE", "ERR"]


class TransportError(RuntimeError):
    """NIXL refused an operation towards a peer (unreachable, gone, not registered)."""


class IncompatiblePeer(ValueError):
    """A peer's KV layout cannot exchange blocks with ours."""


@dataclass(eq=False)
class TransferHandle:
    """One posted READ. `state` is final once it is DONE or ERR (`error` then says why)."""

    peer_engine_id: str
    num_descriptors: int
    num_bytes: int
    state: XferState = "PROC"
    error: str | None = None
    _xfer: Any = field(default=None, repr=False)


@dataclass
class _Peer:
    name: str
    layout: KVLayoutInfo
    metadata: bytes


class NixlTransport:
    """Moves KV block runs between this engine's registered KV cache and its peers'."""

    def __init__(
        self,
        engine_id: str,
        kv_caches: CanonicalKVCaches,
        device_kind: DeviceKind | None = None,
        block_sizes: Sequence[int] = (),
        lease_words: torch.Tensor | None = None,
    ) -> None:
        """`block_sizes` (tokens per block per group), when given, travel in the layout
        and are checked against a peer's; empty means unknown (not checked).
        `lease_words` (int64, host memory: leases.py) are registered too, for peers to
        read one word of (`start_word_read`)."""
        self.engine_id = engine_id
        self.kv_caches = kv_caches  # keeps the registered memory alive as long as we are
        self.device_kind = _device_kind(kv_caches.tensors, device_kind)
        self._tensors = [_tensor_info(t) for t in kv_caches.tensors]
        self._refs = [[DataRefInfo(r.tensor_idx, r.page_size_bytes, r.offset_bytes) for r in refs]
                      for refs in kv_caches.group_data_refs]
        self._pieces = [[PieceInfo(p.key[0], p.key[1], p.offset, p.nbytes) for p in pieces]
                        for pieces in kv_caches.group_pieces]
        if block_sizes and len(block_sizes) != len(self._refs):
            raise ValueError(f"{len(block_sizes)} block sizes for {len(self._refs)} KV cache groups")
        self._block_sizes = list(block_sizes)
        api, self._errors = load_nixl()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(engine_id, config)
        regions = [(t.base_address, t.num_blocks * t.row_bytes, t.device_id, "") for t in self._tensors]
        self._registered = [self._agent.register_memory(regions, self.device_kind)]
        self._lease_words = _word_info(lease_words) if lease_words is not None else None
        if self._lease_words is not None:
            words = self._lease_words
            self._registered.append(self._agent.register_memory(
                [(words.base_address, words.num_blocks * words.row_bytes, 0, "")], "DRAM"))
        self._lease_tensor = lease_words  # kept alive as long as it is registered
        self._peers: dict[str, _Peer] = {}
        self._live: set[TransferHandle] = set()

    # --- handshake ------------------------------------------------------------------
    def agent_metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    @property
    def pieces(self) -> list[list[PieceInfo]]:
        """Per group, which heads this worker's blocks hold where (`KVLayoutInfo.group_pieces`)."""
        return self._pieces

    def local_layout(self, compat_hash: str) -> KVLayoutInfo:
        return KVLayoutInfo(self.engine_id, list(self._tensors), [list(refs) for refs in self._refs],
                            list(self._block_sizes), compat_hash, self.device_kind, self._lease_words,
                            [list(pieces) for pieces in self._pieces])

    def add_peer(self, response: HandshakeResponse, expected_compat_hash: str | None = None) -> str:
        """Load a peer's agent metadata and remember its layout; returns its agent name
        (= its engine id). Idempotent per engine id; a peer that restarted (new metadata)
        replaces the old one. Raises IncompatiblePeer (its hash differs from
        `expected_compat_hash`, or its groups/pages/rows differ from ours) or TransportError."""
        layout = response.layout
        if expected_compat_hash is not None and layout.compat_hash != expected_compat_hash:
            raise IncompatiblePeer(f"incompatible KV layout: peer {layout.engine_id!r} has hash "
                                   f"{layout.compat_hash[:12]}, this engine {expected_compat_hash[:12]} "
                                   f"({COMPAT_DIFFERS})")
        if layout.engine_id == self.engine_id:
            raise IncompatiblePeer(f"peer engine id {layout.engine_id!r} is this engine's own id")
        self._check_shapes(layout)
        known = self._peers.get(layout.engine_id)
        if known is not None and known.metadata == response.agent_metadata:
            known.layout = layout
            return known.name
        if known is not None:
            self.remove_peer(layout.engine_id)
        name = self._load_agent(response.agent_metadata, layout.engine_id)
        self._peers[layout.engine_id] = _Peer(name, layout, response.agent_metadata)
        return name

    def _load_agent(self, metadata: bytes, engine_id: str) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except self._errors as exc:
            raise TransportError(f"could not load the NIXL agent metadata of {engine_id!r}: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        if name != engine_id:
            self._agent.remove_remote_agent(name)
            raise IncompatiblePeer(f"peer's agent is named {name!r} but its layout says engine {engine_id!r}")
        return name

    def _check_shapes(self, layout: KVLayoutInfo) -> None:
        peer = layout.engine_id
        if len(layout.group_data_refs) != len(self._refs):
            raise IncompatiblePeer(f"incompatible KV layout: peer {peer!r} has {len(layout.group_data_refs)} "
                                   f"KV cache groups, this engine {len(self._refs)}")
        if layout.block_sizes and self._block_sizes and layout.block_sizes != self._block_sizes:
            raise IncompatiblePeer(f"incompatible KV layout: peer {peer!r} block sizes {layout.block_sizes}, "
                                   f"this engine {self._block_sizes}")
        if self._holds_other_heads(layout):
            return  # pages differ with the heads held; the pieces say what matches (piece_runs)
        for group_id, (ours, theirs) in enumerate(zip(self._refs, layout.group_data_refs)):
            our_pages = [(r.page_size_bytes, self._tensors[r.tensor_idx].row_bytes) for r in ours]
            their_pages = [(r.page_size_bytes, layout.tensors[r.tensor_idx].row_bytes) for r in theirs]
            if our_pages != their_pages:
                raise IncompatiblePeer(f"incompatible KV layout: group {group_id} of peer {peer!r} has "
                                       f"(page, row) bytes per ref {their_pages}, this engine {our_pages}")

    def _holds_other_heads(self, layout: KVLayoutInfo) -> bool:
        return bool(self._pieces and layout.group_pieces and layout.group_pieces != self._pieces)

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer (e.g. after it failed); a later add_peer connects afresh."""
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        try:
            self._agent.remove_remote_agent(peer.name)
        except self._errors as exc:
            logger.info("removing NIXL peer %r: %s", engine_id, exc)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def peer_units(self, peer_engine_id: str) -> list[list[tuple[str, int]]]:
        """Per group, the keys of the peer's digest units (pd/kv_transfer/digests.py): its
        pieces, or the whole page where it describes none."""
        pieces = self._peer(peer_engine_id).layout.group_pieces
        if not pieces:
            return [[WHOLE] for _ in self._refs]
        return [[(p.kind, p.index) for p in group] for group in pieces]

    # --- transfers ------------------------------------------------------------------
    def start_read(
        self,
        peer_engine_id: str,
        local_block_ids: list[list[int]],
        remote_block_ids: list[list[int]],
        notif: bytes = b"",
        taken: list[set] | None = None,
    ) -> TransferHandle:
        """Post one READ of the peer's `remote_block_ids` into our `local_block_ids`
        (per group, position by position; null positions are skipped). `notif` reaches
        the peer after the data moved; with nothing to move it is sent on its own.

        A peer holding other heads (another tensor-parallel rank) gives the pieces of each
        block we hold and it holds, less those in `taken` (per group: read from another
        rank of the same peer already; filled in here).

        Raises ValueError for an unknown peer or bad block lists. A failure of NIXL or
        the peer does not raise: the handle is then in state ERR."""
        peer = self._peer(peer_engine_id)
        runs = piece_runs(self._pieces, peer.layout.group_pieces, taken or [set() for _ in self._refs])
        local, remote = read_descriptors(self._tensors, self._refs, peer.layout, local_block_ids, remote_block_ids,
                                         runs)
        handle = TransferHandle(peer_engine_id, len(local), int(local[:, 1].sum()))
        if not len(local):
            return self._notify_only(handle, peer, notif)
        return self._post(handle, peer, local, remote, self.device_kind, notif, peer.layout.device_kind)

    def _post(self, handle: TransferHandle, peer: _Peer, local: np.ndarray, remote: np.ndarray,
              local_kind: DeviceKind, notif: bytes, remote_kind: DeviceKind = "DRAM") -> TransferHandle:
        """Post a READ of `remote` descriptors into `local` ones (rows aligned)."""
        try:
            xfer = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, local_kind),
                self._agent.get_xfer_descs(remote, remote_kind),
                peer.name,
                notif,
            )
        except self._errors as exc:
            return self._fail(handle, exc)
        handle._xfer = xfer
        self._live.add(handle)
        try:
            state = self._agent.transfer(xfer)
        except self._errors as exc:
            handle.error = f"posting the READ failed: {exc}"
            state = "ERR"
        self._settle(handle, state)
        return handle

    def start_word_read(self, peer_engine_id: str, remote_index: int, local_index: int,
                        notif: bytes = b"") -> TransferHandle:
        """Post one READ of the peer's lease word `remote_index` into our lease word
        `local_index` (leases.py), carrying `notif`. ValueError for an unknown peer, one
        without lease words, or an index out of range; a failure of NIXL or the peer
        leaves the handle in state ERR."""
        peer = self._peer(peer_engine_id)
        theirs, ours = peer.layout.lease_words, self._lease_words
        if theirs is None or ours is None:
            whose = "peer " + repr(peer_engine_id) if theirs is None else "this engine"
            raise ValueError(f"{whose} has no lease words")
        for index, words, whose in ((remote_index, theirs, "remote"), (local_index, ours, "local")):
            if not 0 <= index < words.num_blocks:
                raise ValueError(f"{whose} lease word {index} out of range [0, {words.num_blocks})")
        local = np.array([[ours.base_address + local_index * ours.row_bytes, ours.row_bytes, 0]], dtype=np.uint64)
        remote = np.array([[theirs.base_address + remote_index * theirs.row_bytes, theirs.row_bytes, 0]],
                          dtype=np.uint64)
        return self._post(TransferHandle(peer_engine_id, 1, ours.row_bytes), peer, local, remote, "DRAM", notif)

    def poll(self, handle: TransferHandle) -> XferState:
        """PROC, DONE or ERR; progresses the transfer. The NIXL request is released as
        soon as it is DONE or ERR. Keep a PROC handle's blocks until it is final."""
        if handle.state != "PROC":
            return handle.state
        try:
            state = self._agent.check_xfer_state(handle._xfer)
        except self._errors as exc:
            handle.error = f"transfer failed: {exc}"
            state = "ERR"
        self._settle(handle, state)
        return handle.state

    def cancel(self, handle: TransferHandle) -> bool:
        """Stop a READ still in progress. True once it is final (NIXL cancelled it, or it
        had ended): nothing more lands in its local blocks. False if NIXL could not
        cancel it now (its release failed): the blocks stay the READ's; try again later."""
        if handle.state != "PROC":
            return True
        try:
            handle._xfer.release()
        except self._errors as exc:
            logger.info("cancelling a READ from %r: %s", handle.peer_engine_id, exc)
            return False
        handle.state, handle.error, handle._xfer = "ERR", "cancelled", None
        self._live.discard(handle)
        return True

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by peer engine id; progresses
        this agent (call it regularly even when expecting nothing)."""
        try:
            notifs = self._agent.get_new_notifs()
        except self._errors as exc:
            logger.warning("reading NIXL notifications failed: %s", exc)
            return {}
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in notifs.items()}

    def send_notif(self, peer_engine_id: str, payload: bytes) -> None:
        """Send a notification without a transfer; raises TransportError if NIXL cannot."""
        peer = self._peer(peer_engine_id)
        try:
            self._agent.send_notif(peer.name, payload)
        except self._errors as exc:
            raise TransportError(f"could not notify {peer_engine_id!r}: {exc}") from exc

    def close(self) -> None:
        """Release transfers, forget peers, deregister memory, drop the agent; idempotent."""
        if self._agent is None:
            return
        for handle in list(self._live):
            handle.error = "transport closed"
            self._settle(handle, "ERR")
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        for registered in self._registered:
            try:
                self._agent.deregister_memory(registered)
            except self._errors as exc:
                logger.warning("deregistering KV memory failed: %s", exc)
        self._agent = None
        self.kv_caches = self._lease_tensor = None

    # --- helpers --------------------------------------------------------------------
    def _peer(self, engine_id: str) -> _Peer:
        try:
            return self._peers[engine_id]
        except KeyError:
            raise ValueError(f"unknown NIXL peer {engine_id!r}: add_peer it first") from None

    def _notify_only(self, handle: TransferHandle, peer: _Peer, notif: bytes) -> TransferHandle:
        if notif:
            try:
                self._agent.send_notif(peer.name, notif)
            except self._errors as exc:
                return self._fail(handle, exc)
        handle.state = "DONE"
        return handle

    def _fail(self, handle: TransferHandle, exc: Exception) -> TransferHandle:
        handle.state, handle.error = "ERR", f"{type(exc).__name__}: {exc}"
        logger.warning("READ from %r failed: %s", handle.peer_engine_id, handle.error)
        return handle

    def _settle(self, handle: TransferHandle, state: str) -> None:
        if state == "PROC":
            return
        handle.state = "DONE" if state == "DONE" else "ERR"
        self._live.discard(handle)
        xfer, handle._xfer = handle._xfer, None
        try:
            xfer.release()
        except self._errors as exc:  # NIXL keeps it on its leak list and retries at teardown
            logger.info("releasing a %s transfer to %r: %s", handle.state, handle.peer_engine_id, exc)


def _word_info(words: torch.Tensor) -> TensorInfo:
    if words.device.type != "cpu" or words.dtype != torch.int64 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError("lease words must be a contiguous 1-D int64 CPU tensor")
    return TensorInfo(words.data_ptr(), words.numel(), words.element_size())


def _tensor_info(tensor: KVCacheBlockTensor) -> TensorInfo:
    return TensorInfo(tensor.base_address, tensor.num_blocks, tensor.page_size_in_bytes,
                      tensor.device.index or 0)


def _device_kind(tensors: Sequence[KVCacheBlockTensor], requested: DeviceKind | None) -> DeviceKind:
    kinds = {"cpu": "DRAM", "cuda": "VRAM"}
    types = {t.device.type for t in tensors}
    if len(types) != 1 or next(iter(types)) not in kinds:
        raise ValueError(f"KV tensors must all be on CPU or all on CUDA, got {sorted(types)}")
    derived = kinds[types.pop()]
    if requested is not None and requested != derived:
        raise ValueError(f"device_kind {requested!r} does not match the KV tensors' memory ({derived})")
    return derived
