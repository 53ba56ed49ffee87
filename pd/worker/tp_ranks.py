"""The tensor-parallel ranks of one engine: rank 0 is the engine's own model runner;
ranks 1..N-1 are processes, each with its shard of the model, its own KV cache memory
(its heads of every block) and a model runner. Ranks 1..K-1 (`--tp-local-ranks`, all by
default) are the engine's children on its node; ranks K..N-1 run on other nodes
(`pd tp-rank`) and join over TCP, proving the deployment's secret (pd/worker/rank_join.py).

Every step the engine sends each rank the step's `SchedulerOutput` over its rank
channel (msgspec frames: pd/worker/rank_channel.py), then runs rank 0's runner; inside
the forward the ranks meet in `torch.distributed` collectives (gloo on CPU, NCCL on
CUDA). Every rank samples from the same gathered logits with the same generators, so
every runner keeps the same tokens; rank 0's output is the engine's, but for the KV
connector: each rank has its own connector worker half (its own KV memory moves), which
says what rank 0's needs of it once built (`rank_info`) and sends its report of every
step back (`collect`).

Faults: a rank that exits, is killed or hangs makes the next collective (or the channel)
fail within `tp_timeout`, and `RankLost` stops the engine; a child rank dies with the
engine (PR_SET_PDEATHSIG), a rank on another node when its channel ends.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from launch.interfaces import interface_of, source_address
from pd.config import EngineConfig
from pd.contracts.connector_api import ConnectorContext, KVConnectorOutput
from pd.contracts.outputs import SchedulerOutput
from pd.distributed.collectives import RankLost
from pd.distributed.shard import TPShard
from pd.kv_transfer.connectors import KV_CONNECTORS
from pd.kv_transfer.signing import SECRET_ENV, secret_from_env
from pd.worker.memory import apply_memory_settings
from pd.worker.model_runner import ModelRunner
from pd.worker.rank_channel import (
    ENCODER,
    FROM_RANK,
    TO_RANK,
    ChannelError,
    Failed,
    RankChannel,
    Ready,
    Setup,
    Step,
    StepDone,
    Stop,
    StoreAddress,
    decode,
    encode,
)
from pd.worker.rank_join import RankListener, join
from pd.worker.rank_setup import build_model, build_runner

logger = logging.getLogger(__name__)

STARTUP_S = 300.0  # a rank's process may take this long to start and join (imports on a loaded host)
_PR_SET_PDEATHSIG = 1


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r's device on the engine's node: on a CUDA engine the r-th device from the
    engine's own (`cuda:2`'s rank 1 is `cuda:3`), else the engine's."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


class TensorParallelRanks:
    """Ranks 1..N-1 of an engine, and rank 0's membership of their group."""

    def __init__(self, config: EngineConfig, context: ConnectorContext) -> None:
        self.size = config.parallel.size
        self.timeout = timedelta(seconds=config.parallel.timeout)
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process: one per process")
        self.connector = KV_CONNECTORS.get(config.transfer.connector)
        self.procs: dict[int, subprocess.Popen] = {}  # the ranks started here, by rank
        self.channels: dict[int, RankChannel] = {}  # ranks 1..N-1, in rank order once started
        self.rank_infos: list[object] = []  # each rank's connector `rank_info`, once ready
        self.kv_bytes: list[int] = []  # each rank's KV cache memory, once ready
        self.store_dir = tempfile.mkdtemp(prefix="pd-tp-store-")
        try:
            self._start(config, context, timedelta(seconds=max(STARTUP_S, config.parallel.timeout)))
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, context: ConnectorContext, startup: timedelta) -> None:
        local = config.parallel.ranks_here
        if local < self.size and not config.transfer.secret:
            raise ValueError("tensor-parallel ranks on other nodes prove the deployment's secret when they join: "
                             "give this server one (PD_KV_TRANSFER_SECRET or --kv-transfer-secret)")
        if local < self.size:
            gloo_on_interface_of(config.parallel.host)  # before the local ranks start: they inherit it
        self.store, address = self._store(config, startup)
        for rank in range(1, local):
            self.channels[rank] = self._spawn(rank)
            self.channels[rank].send(rank_setup(config, rank, address, context))
        if local < self.size:
            listener = RankListener(config.parallel.host, config.parallel.port, config.transfer.secret,
                                    set(range(local, self.size)))
            try:
                joined = listener.wait(startup.total_seconds(), self.check_started)
            finally:
                listener.close()
            for rank in sorted(joined):
                self.channels[rank] = joined[rank]
                joined[rank].send(rank_setup(config, rank, address, context, remote=True))
        self._wait_joined(startup.total_seconds())
        dist.init_process_group(backend(config.model.torch_device), store=self.store, rank=0, world_size=self.size,
                                timeout=self.timeout)

    def _store(self, config: EngineConfig, startup: timedelta) -> tuple[dist.Store, StoreAddress]:
        """The ranks' rendezvous: a file store (no port) when they all run here, a TCP
        store at --tp-host when some run on other nodes."""
        if config.parallel.ranks_here == self.size:
            path = os.path.join(self.store_dir, "store")
            return dist.FileStore(path, self.size), StoreAddress(path=path)
        store = dist.TCPStore(config.parallel.host, 0, self.size, is_master=True, timeout=startup,
                              wait_for_workers=False)
        return store, StoreAddress(host=config.parallel.host, port=store.port)

    def _spawn(self, rank: int) -> RankChannel:
        """A plain child process (the engine may itself be a daemonic multiprocessing
        child, which may not start those), given one end of a socket pair."""
        ours, theirs = socket.socketpair()
        with theirs:
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "pd.worker.tp_ranks", str(theirs.fileno())],
                                                pass_fds=[theirs.fileno()])
        return RankChannel(ours)

    def check_started(self) -> None:
        """RuntimeError if a rank started here has exited while starting."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) while starting")

    def _wait_joined(self, seconds: float) -> None:
        """Until every rank reached the store (it then opens the group at once): the
        group's own timeout is `--tp-timeout`, sized for steps, not for starting Python."""
        keys = [_joined_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + seconds
        while not self.store.check(keys):
            self.check_started()
            self._check_channels(RuntimeError)
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not start within {seconds:.0f} s")
            time.sleep(0.05)

    def wait_ready(self, deadline_seconds: float) -> None:
        """Block until every rank built its model and runner; RuntimeError with a rank's
        reason if one failed or died."""
        deadline = time.monotonic() + deadline_seconds
        for rank, channel in self.channels.items():
            while not channel.poll(0.2):
                self.check_started()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} not ready after {deadline_seconds:.0f} s")
            try:
                message = channel.recv(FROM_RANK, self.timeout.total_seconds())
            except ChannelError as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {exc}") from exc
            if not isinstance(message, Ready):
                reason = message.reason if isinstance(message, Failed) else f"it sent {type(message).__name__}"
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reason}")
            try:
                self.rank_infos.append(decode(message.info, self.connector.rank_info_type))
            except ChannelError as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} sent a bad rank info: {exc}") from exc
            self.kv_bytes.append(message.kv_bytes)

    def check(self) -> None:
        """RankLost if a rank has exited, or its channel ended (one that hangs is found
        by the next collective). Between steps a rank sends nothing: anything readable
        is the end of its channel."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                raise RankLost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
        self._check_channels(RankLost)

    def _check_channels(self, error: Callable[[str], Exception]) -> None:
        for rank, channel in self.channels.items():
            if channel.poll(0):
                raise error(f"tensor-parallel rank {rank} {_out_of_turn(channel)}")

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """Hand the step to every other rank (rank 0 then runs it itself)."""
        metadata = encode(scheduler_output.kv_connector_metadata)
        frame = ENCODER.encode(Step(replace(scheduler_output, kv_connector_metadata=None), metadata))
        for rank, channel in self.channels.items():
            try:
                channel.send_frame(frame)
            except ChannelError as exc:
                raise RankLost(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def collect(self) -> list[KVConnectorOutput]:
        """Every other rank's connector report of the step just run (they end it with
        rank 0, whose collectives they share); RankLost if one is gone, sends anything
        else, or takes longer than `--tp-timeout`."""
        outputs = []
        for rank, channel in self.channels.items():
            try:
                message = channel.recv(FROM_RANK, self.timeout.total_seconds())
            except ChannelError as exc:
                raise RankLost(f"tensor-parallel rank {rank} did not end its step within "
                               f"{self.timeout.total_seconds():g} s: {exc}") from exc
            if not isinstance(message, StepDone):
                raise RankLost(f"tensor-parallel rank {rank} sent {type(message).__name__} in a step")
            outputs.append(message.output)
        return outputs

    def shutdown(self) -> None:
        for channel in self.channels.values():
            try:
                channel.send(Stop())
            except ChannelError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for channel in self.channels.values():
            channel.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def rank_setup(config: EngineConfig, rank: int, store: StoreAddress, context: ConnectorContext,
               remote: bool = False) -> Setup:
    """What rank `rank` is sent to start: the engine's config and connector context
    without the deployment's secret (a rank signs and verifies nothing; the secret never
    crosses the channel). A rank on another node is the only local rank of its node, on
    the engine's device type (`pd tp-rank --device` picks which device)."""
    rank_copy = replace(config, transfer=replace(config.transfer, secret=None, allow_unsigned=True))
    if remote:
        rank_copy = replace(rank_copy, model=replace(config.model, device=config.model.torch_device.partition(":")[0]),
                            parallel=replace(config.parallel, local_ranks=1))
    return Setup(rank_copy, rank, store, replace(context, rank=rank, config=replace(context.config, secret=None)))


def _out_of_turn(channel: RankChannel) -> str:
    """What a rank that sent something out of turn said: its failure, or that it is gone."""
    try:
        message = channel.recv(FROM_RANK, 1.0)
    except ChannelError as exc:
        return f"is gone (its channel: {exc}; the rank exited or its node is gone)"
    return f"failed: {message.reason}" if isinstance(message, Failed) else f"sent {type(message).__name__} out of turn"


def _joined_key(rank: int) -> str:
    return f"pd-tp-rank-{rank}-joined"


def _die_with_parent() -> None:
    """SIGKILL this process when the engine that started it exits, however it exits."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a rank then ends when its channel closes
        pass
    if os.getppid() != parent:  # the engine died before the signal was asked for
        os._exit(1)


def rank_main(channel: RankChannel, pick_device: Callable[[EngineConfig, int], str],
              node_address: str | None = None) -> None:
    """A rank's process: take its setup, join the group, build the shard, its runner and
    its connector half, then run every step the engine sends (and send back the
    connector's report) until it sends Stop or goes away. A rank on another node moves
    its KV on `node_address`, its own node's (the engine's `--kv-host` is not here)."""
    setup = channel.recv(TO_RANK)
    if not isinstance(setup, Setup):
        raise ChannelError(f"the engine sent {type(setup).__name__} before a setup")
    if node_address is not None:
        config = replace(setup.context.config, host=node_address)
        setup = msgspec.structs.replace(setup, context=replace(setup.context, config=config))
    rank = setup.rank
    apply_memory_settings()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    try:
        runner = _build(setup, pick_device(setup.config, rank))
    except BaseException as exc:
        channel.send(Failed(f"{type(exc).__name__}: {exc}"))
        raise
    channel.send(Ready(encode(runner.connector.rank_info()), runner.kv_allocation.nbytes))
    metadata_type = KV_CONNECTORS.get(setup.config.transfer.connector).metadata_type
    try:
        while not isinstance(step := channel.recv(TO_RANK), Stop):
            if not isinstance(step, Step):
                raise ChannelError(f"the engine sent {type(step).__name__} in a step")
            step.output.kv_connector_metadata = decode(step.metadata, metadata_type)
            channel.send(StepDone(runner.execute_model(step.output).kv_connector_output))
    except ChannelError as exc:
        logger.info("the engine went away (%s): rank %d ends", exc, rank)
    finally:
        runner.shutdown()
        dist.destroy_process_group()


def _build(setup: Setup, device: str) -> ModelRunner:
    config, rank = setup.config, setup.rank
    if config.parallel.num_threads is not None:
        torch.set_num_threads(config.parallel.num_threads)
    size, timeout = config.parallel.size, timedelta(seconds=config.parallel.timeout)
    if setup.store.path:
        store = dist.FileStore(setup.store.path, size)
    else:
        store = dist.TCPStore(setup.store.host, setup.store.port, size, is_master=False,
                              timeout=timedelta(seconds=STARTUP_S))
    store.set(_joined_key(rank), "1")
    dist.init_process_group(backend(device), store=store, rank=rank, world_size=size, timeout=timeout)
    shard = TPShard(rank, size)
    model_config, model = build_model(config, shard, device)
    connector = KV_CONNECTORS.get(config.transfer.connector).build_worker(setup.context)
    runner = build_runner(config, model_config, model, device, connector)
    torch.manual_seed(config.model.seed)  # as rank 0 does once built: the same draws for unseeded requests
    return runner


def gloo_on_interface_of(address: str) -> None:
    """Gloo's connections between ranks on other nodes go over the interface holding
    `address`, this node's address on the ranks' network. Without it gloo takes the
    address the host name resolves to, which may be loopback or another network: ranks
    on two hosts timed out connecting to 127.0.0.1 (tests/multihost/test_ray_across_hosts.py).
    An operator's GLOO_SOCKET_IFNAME wins."""
    interface = interface_of(address)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)


def run_remote_rank(address: str, rank: int, device: str | None, timeout: float) -> int:
    """`pd tp-rank`: join the server at `address` as `rank` and serve its steps; the
    exit code (1 with the reason when it cannot join)."""
    secret = secret_from_env()
    if not secret:
        raise SystemExit(f"pd tp-rank: a rank proves the deployment's secret when it joins: set {SECRET_ENV}")
    host, _, port = address.rpartition(":")
    try:
        channel = join(host.strip("[]"), int(port), rank, secret, timeout)
    except (ChannelError, ValueError) as exc:
        raise SystemExit(f"pd tp-rank: {exc}") from None
    here = source_address(host.strip("[]"))  # this node's side of the way to the server
    gloo_on_interface_of(here)
    rank_main(channel, lambda config, _: device or config.model.torch_device, node_address=here)
    return 0


if __name__ == "__main__":
    _die_with_parent()
    rank_main(RankChannel(socket.socket(fileno=int(sys.argv[1]))),
              lambda config, rank: rank_device(config.model.torch_device, rank))
