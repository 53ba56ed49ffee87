"""EngineCore: the scheduler, the KV cache manager, the model runner and the connector,
stepped as schedule -> execute -> update.

This object runs in whatever process owns it: in-process for `pd.LLM`, in its own
process behind ZMQ for `pd serve` (see `process.py`).
"""

from __future__ import annotations

import time
import uuid

import torch

from pd.config import EngineConfig, SchedulerConfig, TierSettings
from pd.contracts.request import Request, RequestOutput
from pd.distributed.shard import TPShard
from pd.engine.ipc_messages import EngineInfo, EngineStats, HistogramSnapshot
from pd.engine.kv_event_publisher import KVEventPublisher, KVEvents, NoKVEvents
from pd.histogram import Histogram
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.spec import KVCacheConfig, MambaSpec
from pd.kv_offload.connector import (
    inner_worker,
    offload_description,
    offload_figures,
    offload_load_seconds,
    tiered_scheduler,
    with_tiers,
)
from pd.kv_transfer.connectors import KV_CONNECTORS
from pd.scheduling.scheduler import Scheduler
from pd.structured.matchers import GrammarMatchers
from pd.tokenizer import Tokenizer
from pd.worker.memory import apply_memory_settings
from pd.worker.rank_setup import build_model, build_runner, connector_context, kv_cache_config
from pd.worker.tp_ranks import TensorParallelRanks, rank_device

STEP_PARTS = ("schedule", "execute", "update")  # where a step's wall time goes (`EngineCore.step`)


def group_names(config: KVCacheConfig) -> list[str]:
    """Readable, unique names of the KV cache groups, e.g. "0:full_attention"."""
    kinds = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window",
             "MambaSpec": "mamba"}
    return [f"{i}:{kinds.get(type(g.spec).__name__, type(g.spec).__name__)}" for i, g in enumerate(config.groups)]


class EngineCore:
    def __init__(self, config: EngineConfig, keep_logits: bool = False) -> None:
        if not config.is_resolved:
            raise ValueError("an engine is started with a resolved config (EngineConfig.resolve())")
        apply_memory_settings()
        torch.manual_seed(config.model.seed)
        if config.parallel.num_threads is not None:
            torch.set_num_threads(config.parallel.num_threads)
        self.config = config
        self.num_steps = 0
        self.step_seconds = dict.fromkeys(STEP_PARTS, 0.0)
        device = config.model.torch_device
        self.engine_id = f"pd-{uuid.uuid4().hex[:12]}"
        self.connector_context = connector_context(config, self.engine_id)
        self.tp_ranks = TensorParallelRanks(config, self.connector_context) if config.parallel.size > 1 else None
        try:
            self._build(config, device, keep_logits)
        except BaseException:  # ranks already started must not outlive a failed start
            if self.tp_ranks is not None:
                self.tp_ranks.shutdown()
            raise
        self.logits: dict[str, list[torch.Tensor]] = {}
        # Unseeded requests sample from the global generator: every tensor-parallel rank
        # starts serving from the same state (building may have drawn from it unequally).
        torch.manual_seed(config.model.seed)

    def _build(self, config: EngineConfig, device: str, keep_logits: bool) -> None:
        """Rank 0's model, KV cache and runner, the connector (given the other ranks'
        agents) and the scheduler."""
        self.model_config, self.model = build_model(config, TPShard(0, config.parallel.size),
                                                    rank_device(device, 0))
        if self.tp_ranks is not None:
            self.tp_ranks.wait_ready(deadline_seconds=max(600.0, config.parallel.timeout))
        self.max_model_len = self.model_config.context_len
        self.kv_cache_config = kv_cache_config(config, self.model_config, self.model)
        self.kv_cache_manager = KVCacheManager(self.kv_cache_config, config.cache.enable_prefix_caching,
                                               self.max_model_len,
                                               record_events=config.telemetry.events_port is not None)
        self.kv_events = self._kv_events()
        connector, context = KV_CONNECTORS.get(config.transfer.connector), self.connector_context
        tiers = TierSettings(config.offload, context.compat_hash, self.engine_id)
        worker_connector = with_tiers(connector.build_worker(context), tiers)
        self.runner = build_runner(config, self.model_config, self.model, rank_device(device, 0), worker_connector,
                                   keep_logits)
        if self.tp_ranks is not None:
            worker_connector.add_ranks(self.tp_ranks.rank_infos)
        grammars = GrammarMatchers(lambda: Tokenizer(config.model.path).json(), self.model_config.eos_token_ids)
        scheduler_connector = tiered_scheduler(connector.build_scheduler(context, inner_worker(worker_connector)),
                                               self.kv_cache_manager, worker_connector)
        self.scheduler = Scheduler(self._scheduler_config(), self.kv_cache_manager, scheduler_connector, grammars)

    @property
    def kv_events_endpoints(self) -> dict[str, str] | None:
        """Where KV events are published and replayed, as bound (None: they are not)."""
        return self.kv_events.endpoints

    def _kv_events(self) -> KVEvents:
        telemetry = self.config.telemetry
        if telemetry.events_port is None:
            return NoKVEvents()
        def held() -> list:  # every block held, in the KV cache and in the offload tiers
            return self.kv_cache_manager.pool.cached_events() + self.scheduler.connector.held_events()

        return KVEventPublisher(self.engine_id, telemetry.events_host, telemetry.events_port, telemetry.replay_port,
                                held)

    def compat_hash(self) -> str:
        """Equal for two engines whose KV blocks mean the same thing byte for byte, whatever
        their tensor-parallel sizes: it is taken of the whole model's groups (which heads
        a rank holds, its pieces, the handshake says)."""
        return self.connector_context.compat_hash

    def _scheduler_config(self) -> SchedulerConfig:
        mamba = [g.spec.block_size for g in self.kv_cache_config.groups if isinstance(g.spec, MambaSpec)]
        return SchedulerConfig(self.config.scheduler, self.max_model_len, self.model_config.eos_token_ids,
                                mamba[0] if mamba else None)

    def add_request(self, request: Request) -> None:
        """Queue the request; ValueError if it cannot be served (HeldBlocksLimitError if
        it would keep blocks for a decode server past this server's share)."""
        self._check_token_ids(request)
        self.scheduler.add_request(request)

    def _check_token_ids(self, request: Request) -> None:
        """Every token id the request brings must index the vocabulary: one that does not
        would fail the batch it is computed in. This is the engine's own door, for every
        request whoever sends it (the server checks a body's ids too, to name the field
        in its 400; `pd.LLM` does not)."""
        vocab = self.model_config.vocab_size
        first = list(request.remote_prefill.first_token_ids) if request.remote_prefill else []
        bias = [token for token, _ in request.sampling_params.logit_bias]
        for what, ids in (("prompt", request.prompt_token_ids),
                          (f"resume.choices.{request.index}.token_ids", request.output_token_ids),
                          ("stop_token_ids", request.sampling_params.stop_token_ids),
                          ("kv_transfer_params.first_token_ids", first), ("logit_bias", bias)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def release_held(self, request_ids: list[str]) -> list[str]:
        """Free now the blocks kept for these finished prefills; the ids that were held."""
        return self.scheduler.remote_kv.release_held(request_ids)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.scheduler.abort_requests(request_ids)

    def migrate_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Hand these requests on at step boundaries (Scheduler.migrate); the outputs of
        those handed on now."""
        return self.scheduler.migrate(request_ids)

    def step(self) -> list[RequestOutput]:
        """One schedule -> execute -> update; the outputs of this step. The wall time of
        each part is added to `step_seconds` (execute: inputs, the model, sampling)."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        if self.tp_ranks is not None:
            self.tp_ranks.send(scheduler_output)
        runner_output = self.runner.execute_model(scheduler_output)
        if self.tp_ranks is not None:
            self.runner.connector.add_rank_outputs(self.tp_ranks.collect())
        self._keep_logits(runner_output.logits)
        executed = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.kv_events.publish(self.kv_cache_manager.pool.take_events() + self.scheduler.connector.take_events())
        seconds, done = self.step_seconds, time.perf_counter()
        seconds["schedule"] += scheduled - start
        seconds["execute"] += executed - scheduled
        seconds["update"] += done - executed
        self.scheduler.step_budget.took(done - start)
        self.num_steps += 1
        return outputs

    def has_work(self) -> bool:
        """Requests to step, blocks kept for the connector, or transfers that progress
        only when polled (a step with no request only polls them)."""
        return self.scheduler.has_work or self.runner.connector.wants_polling

    def check_ranks(self) -> None:
        """RankLost if a tensor-parallel rank has exited: checked every loop turn, so an
        idle engine finds it too."""
        if self.tp_ranks is not None:
            self.tp_ranks.check()

    def has_compute_work(self) -> bool:
        return self.scheduler.has_compute_work

    def info(self) -> EngineInfo:
        """What the server is told of this engine once it is ready."""
        kv, model = self.kv_cache_config, self.model_config
        return EngineInfo(engine_id=self.engine_id, kv_connector=self.config.transfer.connector,
                          max_model_len=self.max_model_len, vocab_size=model.vocab_size,
                          eos_token_ids=sorted(model.eos_token_ids), group_names=group_names(kv),
                          num_blocks=kv.num_blocks, block_sizes=kv.block_sizes, architectures=model.architectures,
                          kv_events=self.kv_events_endpoints, compat_hash=self.compat_hash(),
                          kv_offload=offload_description(self.runner.connector), stats=self.stats())

    def stats(self) -> EngineStats:
        prefix = self.kv_cache_manager.stats
        counters, histograms, by_rank, path = self._transfer_figures()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv_cache_manager.usage, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            group_names=group_names(self.kv_cache_config),
            group_queries=list(prefix.group_queries), group_hits=list(prefix.group_hits),
            kv_transfer=counters, kv_transfer_histograms=histograms, kv_transfer_by_rank=by_rank,
            kv_transfer_path=path,
            kv_load_failures=dict(self.scheduler.remote_kv.load_failures),
            kv_prefix_reads_skipped=self.scheduler.remote_kv.reads_skipped,
            kv_cache_bytes=[self.runner.kv_allocation.nbytes, *(self.tp_ranks.kv_bytes if self.tp_ranks else [])],
            prompt_tokens_by_source=dict(self.scheduler.prompt_sources.counts),
            kv_offload=offload_figures(self.scheduler.connector, self.runner.connector),
            kv_offload_load_seconds={tier: _snapshot(h)
                                     for tier, h in offload_load_seconds(self.runner.connector).items()},
            malformed_messages=self._malformed_messages(), kv_events_replies_dropped=self.kv_events.dropped_replies,
            num_steps=self.num_steps, step_seconds=dict(self.step_seconds))

    def _malformed_messages(self) -> dict[str, int]:
        """Messages dropped as malformed, by the listener that received them (the engine
        loop adds its input's)."""
        return {"kv_events_replay": self.kv_events.malformed_requests} | self.runner.connector.malformed_messages()

    def _transfer_figures(self) -> tuple[dict[str, float], dict[str, HistogramSnapshot], dict[str, dict[int, int]],
                                         str]:
        """The connector's transfer counters, histograms, per-rank figures and path
        (empty without a connector that counts)."""
        connector = self.runner.connector
        stats = getattr(connector, "stats", None)
        if stats is None:
            return {}, {}, {}, ""
        histograms = {name: _snapshot(h) for name, h in stats.histograms().items()}
        counters = stats.counters() | {"requests_held": float(connector.num_requests_held)}
        return counters, histograms, stats.by_rank(), getattr(stats, "path", "")

    def _keep_logits(self, logits: dict[str, torch.Tensor] | None) -> None:
        for req_id, row in (logits or {}).items():
            self.logits.setdefault(req_id, []).append(row)

    def shutdown(self) -> None:
        self.scheduler.grammars.shutdown()
        self.kv_events.close()
        self.runner.shutdown()
        if self.tp_ranks is not None:
            self.tp_ranks.shutdown()


def _snapshot(histogram: Histogram) -> HistogramSnapshot:
    return HistogramSnapshot(list(histogram.buckets), list(histogram.counts), histogram.total)
