"""The tensor-parallel ranks of one engine: rank 0 is the engine's own model runner;
ranks 1..N-1 are processes the engine starts, each with its shard of the model, its
own KV cache memory (its heads of every block) and a model runner.

Every step the engine sends each rank the step's `SchedulerOutput` (over a socket pair
to its own child: nothing from a network is unpickled), then runs rank 0's runner; inside the
forward the ranks meet in `torch.distributed` collectives (gloo on CPU, NCCL on CUDA)
on a group rank 0 opens on 127.0.0.1. Every rank samples from the same gathered
logits with the same generators, so every runner keeps the same tokens; rank 0's
output is the engine's, but for the KV connector: each rank has its own connector
worker half (its own KV memory moves), which says what rank 0's needs of it once built
(`rank_info`) and sends its report of every step back (`collect`).

Faults: a rank that exits, is killed or hangs makes the next collective (or send) fail
within `tp_timeout`, and `RankLost` stops the engine; a rank dies with the engine
(PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pd.config import EngineConfig
from pd.distributed.collectives import RankLost
from pd.distributed.shard import TPShard
from pd.kv_transfer.connectors import KV_CONNECTORS
from pd.scheduling.connector_api import ConnectorContext, KVConnectorOutput
from pd.scheduling.outputs import SchedulerOutput
from pd.worker.model_runner import ModelRunner
from pd.worker.rank_setup import build_model, build_runner

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
STARTUP_S = 300.0  # a rank's process may take this long to start and join (imports on a loaded host)
_PR_SET_PDEATHSIG = 1


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: on a CUDA engine the r-th device from the engine's own (`cuda:2`'s
    rank 1 is `cuda:3`), else the engine's."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


class TensorParallelRanks:
    """Ranks 1..N-1 of an engine, and rank 0's membership of their group."""

    def __init__(self, config: EngineConfig, context: ConnectorContext) -> None:
        self.size = config.tensor_parallel_size
        self.timeout = timedelta(seconds=config.tp_timeout)
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process: one per process")
        startup = timedelta(seconds=max(STARTUP_S, config.tp_timeout))
        self.store = dist.TCPStore(HOST, 0, self.size, is_master=True, timeout=startup, wait_for_workers=False)
        self.pipes: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.rank_infos: list[object] = []  # each rank's connector `rank_info`, once ready
        self.kv_bytes: list[int] = []  # each rank's KV cache memory, once ready
        for rank in range(1, self.size):
            self._start(config, rank, context)
        self._wait_joined(startup.total_seconds())
        dist.init_process_group(backend(config.torch_device), store=self.store, rank=0, world_size=self.size,
                                timeout=self.timeout)

    def _start(self, config: EngineConfig, rank: int, context: ConnectorContext) -> None:
        """A plain child process (the engine may itself be a daemonic multiprocessing
        child, which may not start those), given one end of a socket pair."""
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen([sys.executable, "-m", "pd.worker.tp_ranks", str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()])
        pipe = Connection(ours.detach())
        pipe.send((config, rank, self.store.port, replace(context, rank=rank)))
        self.pipes.append(pipe)
        self.procs.append(proc)

    def _wait_joined(self, seconds: float) -> None:
        """Until every rank reached the store (it then opens the group at once): the
        group's own timeout is `--tp-timeout`, sized for steps, not for starting Python."""
        keys = [_joined_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + seconds
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not start within {seconds:.0f} s")
            time.sleep(0.05)

    def wait_ready(self, deadline_seconds: float) -> None:
        """Block until every rank built its model and runner; RuntimeError with a rank's
        reason if one failed or died."""
        deadline = time.monotonic() + deadline_seconds
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs), start=1):
            while not pipe.poll(0.2):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} not ready after {deadline_seconds:.0f} s")
            kind, detail = pipe.recv()
            if kind != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")
            info, kv_bytes = detail
            self.rank_infos.append(info)
            self.kv_bytes.append(kv_bytes)

    def check(self) -> None:
        """RankLost if a rank has exited (one that hangs is found by the next collective)."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RankLost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """Hand the step to every other rank (rank 0 then runs it itself)."""
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(scheduler_output)
            except (OSError, ValueError) as exc:
                raise RankLost(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def collect(self) -> list[KVConnectorOutput]:
        """Every other rank's connector report of the step just run (they end it with
        rank 0, whose collectives they share); RankLost if one is gone or takes longer
        than `--tp-timeout`."""
        outputs = []
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                if not pipe.poll(self.timeout.total_seconds()):
                    raise RankLost(f"tensor-parallel rank {rank} did not end its step within "
                                   f"{self.timeout.total_seconds():g} s")
                outputs.append(pipe.recv())
            except (EOFError, OSError) as exc:
                raise RankLost(f"tensor-parallel rank {rank} is gone: {exc}") from exc
        return outputs

    def shutdown(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _joined_key(rank: int) -> str:
    return f"pd-tp-rank-{rank}-joined"


def _die_with_parent() -> None:
    """SIGKILL this process when the engine that started it exits, however it exits."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a rank then ends when its pipe closes
        pass
    if os.getppid() != parent:  # the engine died before the signal was asked for
        os._exit(1)


def rank_main(config: EngineConfig, rank: int, store_port: int, context: ConnectorContext,
              pipe: Connection) -> None:
    """A rank's process: join the group, build the shard, its runner and its connector
    half, then run every step rank 0 sends (and send back the connector's report) until
    it sends None or goes away."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    try:
        runner = _build(config, rank, store_port, context)
    except BaseException as exc:
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    pipe.send(("ready", (runner.connector.rank_info(), runner.kv_allocation.nbytes)))
    try:
        while True:
            step = pipe.recv()
            if step is None:
                break
            pipe.send(runner.execute_model(step).kv_connector_output)
    except EOFError:
        pass  # the engine went away
    finally:
        runner.shutdown()
        dist.destroy_process_group()


def _build(config: EngineConfig, rank: int, store_port: int, context: ConnectorContext) -> ModelRunner:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    size, timeout = config.tensor_parallel_size, timedelta(seconds=config.tp_timeout)
    store = dist.TCPStore(HOST, store_port, size, is_master=False, timeout=timedelta(seconds=STARTUP_S))
    store.set(_joined_key(rank), "1")
    dist.init_process_group(backend(config.torch_device), store=store, rank=rank, world_size=size, timeout=timeout)
    shard = TPShard(rank, size)
    device = rank_device(config.torch_device, rank)
    model_config, model = build_model(config, shard, device)
    connector = KV_CONNECTORS.get(config.kv_connector).build_worker(context)
    runner = build_runner(config, model_config, model, device, connector)
    torch.manual_seed(config.seed)  # as rank 0 does once built: the same draws for unseeded requests
    return runner


if __name__ == "__main__":
    _die_with_parent()
    _pipe = Connection(int(sys.argv[1]))
    _config, _rank, _port, _context = _pipe.recv()
    rank_main(_config, _rank, _port, _context, _pipe)
