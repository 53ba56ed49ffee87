"""The NIXL connector's two halves, built for an engine (the `nixl` entry of
pd/kv_transfer/connectors.py)."""

from __future__ import annotations

from connectors.nixl.peer_messages import RankAgent
from connectors.nixl.scheduler import NixlConnectorMetadata, NixlConnectorScheduler
from connectors.nixl.worker import NixlConnectorWorker, NixlWorkerConfig
from pd.contracts.connector_api import ConnectorContext, KVConnector


class NixlConnector(KVConnector):
    metadata_type = NixlConnectorMetadata
    rank_info_type = RankAgent

    @staticmethod
    def build_worker(context: ConnectorContext) -> NixlConnectorWorker:
        return NixlConnectorWorker(NixlWorkerConfig(context.engine_id, context.compat_hash, context.config,
                                                    rank=context.rank, tp_size=context.tp_size))

    @staticmethod
    def build_scheduler(context: ConnectorContext, worker: NixlConnectorWorker) -> NixlConnectorScheduler:
        """After `worker.register_kv_caches`: its side channel is listening by then."""
        config = context.config
        return NixlConnectorScheduler(context.engine_id, config.host, worker.side_channel_port,
                                      context.block_sizes, config.lease_seconds, secret=config.secret,
                                      leases=worker.leases, tp_size=context.tp_size, digests=worker.digest_book)
