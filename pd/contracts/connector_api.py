"""The KV connector API: how an engine hands KV blocks to, and takes them from, elsewhere.

A connector has two halves. The **scheduler half** lives with the scheduler and decides
what to load or keep; the **worker half** lives with the model runner and moves bytes.
They talk only through `KVConnectorMetadata` (scheduler -> worker, once per step) and
`KVConnectorOutput` (worker -> scheduler, once per step). A connector sees blocks and
byte ranges (`CanonicalKVCaches`), never the model.

Block ownership:
- Blocks a request holds belong to the scheduler's KV cache manager. When
  `update_state_after_alloc` is called the blocks for the request's external tokens are
  allocated and owned by the request; the worker half may write them until it reports
  the request in `finished_recving`. Until then the scheduler keeps the request in
  `WAITING_FOR_REMOTE_KVS` and neither computes on those blocks nor caches them.
- `request_finished` is called exactly once per request, when it finishes, before its
  blocks are freed. If it returns `delay_free=True` the scheduler keeps the blocks until
  the worker half reports the request in `finished_sending`; only then are they freed.

Connectors are chosen by name (pd/kv_transfer/connectors.py): each entry is a `KVConnector` that
builds both halves from a `ConnectorContext`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd.kv_transfer.connector_config import ConnectorConfig

if TYPE_CHECKING:
    from pd.contracts.request import Request
    from pd.kv_cache.canonical import CanonicalKVCaches
    from pd.kv_cache.kv_cache_manager import KVCacheBlocks
    from pd.kv_transfer.params import RemotePrefillParams


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector is built from: the engine's id (handed out in
    kv_transfer_params), the connector's settings, a hash equal for engines whose KV
    blocks mean the same thing byte for byte (pd/kv_transfer/compat.py), the block
    size of each KV cache group, and which tensor-parallel rank of how many builds it
    (every rank has a worker half for its own KV memory; rank 0's is the engine's, and
    the scheduler half talks to it alone)."""

    engine_id: str
    config: ConnectorConfig
    compat_hash: str
    block_sizes: list[int]
    rank: int = 0  # the tensor-parallel rank whose worker half this is
    tp_size: int = 1


class KVLoadRefused(Exception):
    """Raised by `get_num_new_matched_tokens`: this request's external KV cannot be loaded
    (its parameters do not fit it). The scheduler then computes the request here or fails
    it, per its load failure policy; the connector has already told the KV's holder."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"the KV of request {request_id} cannot be loaded: {reason}")
        self.request_id = request_id
        self.reason = reason


class KVHeldAlready(KVLoadRefused):
    """Raised by `get_num_new_matched_tokens` for a prefix this server's own prefix cache
    holds already (the proxy's view of it lagged, or its events cover only the full
    attention group): nothing is loaded, which is no failure. The scheduler takes its own
    hit; the connector has already told the holder to free the export."""


@dataclass
class KVConnectorMetadata:
    """What the scheduler half tells the worker half in one step (connector-specific)."""


@dataclass
class OffloadReport:
    """What an offload tier's worker half reports after a step (pd/kv_offload): blocks,
    as (block hash, group), whose store ended stored or unstored, held blocks that failed
    their checksum (dropped), and why the tier is off (None: it is on)."""

    stored: list[tuple[bytes, int]] = field(default_factory=list)
    store_failed: list[tuple[bytes, int]] = field(default_factory=list)
    corrupt: list[tuple[bytes, int]] = field(default_factory=list)
    off: str | None = None


@dataclass
class KVConnectorOutput:
    """What the worker half reports back after a step: requests whose blocks finished
    sending (their delayed free may happen) or receiving (they may be scheduled), and
    requests whose load failed (request id -> why, for logs and error messages).
    `unverified`: received requests whose KV could not be verified as the holder's for
    their prompt (parameters not signed with the deployment's secret): they may use it,
    but nothing of theirs enters the prefix cache. `load_sizes`: what each finished load
    moved (bytes, transfer descriptors): a tensor-parallel rank > 0's own share, for rank
    0's figures; rank 0's, every rank's together (a request's trace shows them). A rank
    > 0 also reports its digests of requests held for readers (`digests`) and its share
    of a request received whose bytes differ from the holder's digests
    (`digest_mismatches`, why), for rank 0 to decide on."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)
    unverified: set[str] = field(default_factory=set)
    load_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # (bytes, descriptors) loaded
    digests: dict[str, bytes] = field(default_factory=dict)  # a rank > 0: its digests of held requests' blocks
    digest_mismatches: dict[str, str] = field(default_factory=dict)  # a rank > 0: received, but not as digested
    offload: dict[str, OffloadReport] | None = None  # the offload tiers' reports, by tier (pd/kv_offload)


class KVConnectorScheduler(ABC):
    """The scheduler half."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past the local prefix hit (`num_computed_tokens`) that can be loaded
        from outside, and whether they load asynchronously (the request then waits in
        WAITING_FOR_REMOTE_KVS). Called before allocation; may be called again for a
        request whose allocation failed. Raises KVLoadRefused for external KV that
        exists but cannot be loaded into this request; the connector never marks the
        request itself."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Blocks are allocated for the request: `blocks` are all it holds, positional per
        group (hits, nulls and new ones; `blocks.get_unfilled_block_ids()` names the new
        ones, which the connector owns for writing until it reports the load finished or
        failed). Remember what to load."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's instructions for the worker half; resets per-step state."""

    @abstractmethod
    def request_finished(self, request: Request,
                         block_ids: list[list[int]]) -> tuple[bool, RemotePrefillParams | None]:
        """Called exactly once per finished request, before its blocks are freed. Returns
        (delay_free, kv_transfer_params for the response)."""

    def prompt_computed(self, request: Request, block_ids: list[list[int]]) -> None:
        """Called at schedule time for a request whose prompt's last tokens the step
        computes (its prompt's KV is complete once the step ran), with its blocks."""

    @property
    def hands_on_after_a_step(self) -> bool:
        """Whether a request to be handed on (`Scheduler.migrate`) is handed on only after
        a step computed it since it was marked (`handing_on`: the connector acts on its
        KV as it stands then, digesting what a reader will read)."""
        return False

    def handing_on(self, request: Request, block_ids: list[list[int]], num_tokens: int) -> None:
        """Called at schedule time, when `hands_on_after_a_step`, for a request to be handed
        on that the step computes: its blocks, which hold the KV of `num_tokens` tokens once
        the step ran."""

    def requests_waiting(self, requests: Iterable[Request]) -> None:
        """Called once per step with the requests waiting for admission (in order); a
        connector may act for those whose KV it is to load (keep a remote copy alive)."""

    def take_events(self) -> list:
        """KV events (kv_events/messages.py) of blocks the connector's own media stored or
        removed since the last call (an offload tier's)."""
        return []

    def held_events(self) -> list:
        """Every block the connector's own media hold now, as events storing them (for a
        replay snapshot)."""
        return []

    @property
    def has_work(self) -> bool:
        """Work of the connector's own that needs steps although no request runs (blocks
        pinned for a copy under way)."""
        return False

    def release(self, request_id: str) -> None:
        """A finished request whose blocks are kept (`delay_free`) will not be read: have
        the worker half report it in `finished_sending` so they are freed now. Called
        only for requests the scheduler keeps blocks for."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's report for the last step."""


class KVConnectorWorker(ABC):
    """The worker half."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        """Called once, after the KV cache memory is allocated."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's loads (non-blocking)."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Progress transfers; report what completed since the last call."""

    @property
    def wants_polling(self) -> bool:
        """True while transfers may be under way that move only when this engine calls
        `get_finished` (no progress thread): the engine then steps even with no request."""
        return False

    def malformed_messages(self) -> dict[str, int]:
        """Messages from peers dropped as malformed so far, by listener (for metrics)."""
        return {}

    # --- tensor parallelism: ranks 1..N-1 report to rank 0 over their rank channels ---
    def rank_info(self) -> object:
        """A rank > 0: what rank 0 needs of this rank's half once its KV caches are
        registered (of the connector's `rank_info_type`: it crosses the rank channel)."""
        return None

    def add_ranks(self, infos: list[object]) -> None:
        """Rank 0: every other rank's `rank_info`, in rank order, before the first step."""

    def add_rank_outputs(self, outputs: list[KVConnectorOutput]) -> None:
        """Rank 0, after each step: what every other rank's `get_finished` reported, in
        rank order (a rank's finished and failed loads are its share of a request's)."""

    def shutdown(self) -> None:
        """Release transfer resources; called once at engine shutdown."""


class NullConnectorScheduler(KVConnectorScheduler):
    """Serving alone: nothing arrives from outside, nothing is kept for anyone."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request,
                         block_ids: list[list[int]]) -> tuple[bool, RemotePrefillParams | None]:
        return False, None


class NullConnectorWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        pass

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return KVConnectorOutput()


class KVConnector(ABC):
    """A connector as registered by name (pd/kv_transfer/connectors.py): how to build its halves.
    The engine builds the worker half, hands it the KV caches
    (`register_kv_caches`), then builds the scheduler half. `metadata_type` and
    `rank_info_type` are what its metadata and `rank_info` decode as when they cross to
    and from tensor-parallel ranks (msgspec schemas: a rank may be on another node)."""

    metadata_type: type = KVConnectorMetadata
    rank_info_type: type = type(None)

    @staticmethod
    @abstractmethod
    def build_worker(context: ConnectorContext) -> KVConnectorWorker: ...

    @staticmethod
    @abstractmethod
    def build_scheduler(context: ConnectorContext, worker: KVConnectorWorker) -> KVConnectorScheduler: ...


class NullConnector(KVConnector):
    """The `null` entry: serving alone."""

    @staticmethod
    def build_worker(context: ConnectorContext) -> NullConnectorWorker:
        return NullConnectorWorker()

    @staticmethod
    def build_scheduler(context: ConnectorContext, worker: KVConnectorWorker) -> NullConnectorScheduler:
        return NullConnectorScheduler()
