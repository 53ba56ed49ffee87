"""EngineClient: the server's handle on its engine-core process.

`EngineClient.start(config)` (synchronous, before the server's event loop runs) spawns
`run_engine_core` in a fresh process, binds the two ZMQ sockets it connects to (ipc://
paths in a temp dir of this engine's own, `pd-engine-<server pid>-*`, so engines never
collide) and waits for `Ready`. Requests then go out as msgspec messages and their
outputs come back through one reader task, routed to a queue per request. `restart()`
puts a new engine-core process in place of a dead one (the server's supervisor decides
whether to). Folders of servers that died without removing theirs (kill -9) are removed
when the next one starts (`ipc_dirs.py`).

Event loop: the client works in whichever asyncio loop uses it. Its two background
tasks (the output reader, and the watcher that fails every pending request with
`EngineDeadError` when the process dies) start on first use inside the running loop;
a server should `await client.attach()` at startup so that a death is noticed even
before the first request. Used from a new loop (each `asyncio.run` in tests), it
re-attaches there; requests still pending in the old loop are forgotten. All methods
are meant to be called from the loop's thread (and `start`/`shutdown` from any thread
while no loop is using the client, or from the loop's thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from pd.config import EngineConfig
from pd.contracts.request import sequence_id
from pd.engine.ipc_dirs import new_ipc_dir
from pd.engine.ipc_messages import (
    AbortRequests,
    EngineFailed,
    EngineInfo,
    EngineRequest,
    EngineStats,
    MigrateRequests,
    Ready,
    ReleaseKV,
    RequestOutput,
    Shutdown,
    StartupFailed,
    StepOutputs,
    encode,
    output_decoder,
)
from pd.engine.process import run_engine_core
from wire.codes import INVALID_REQUEST

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2  # how often the watcher checks that the process is alive
KILL_WAIT_S = 5.0  # how long terminate() is given before kill()
RESTART_JOIN_S = 5.0  # how long a dead engine is given to finish exiting before a new one starts


class EngineStartupError(RuntimeError):
    """The engine-core process failed to build its core, died or timed out starting."""


class RequestRefusedError(ValueError):
    """The engine did not admit the request; `code` (pd.errors) says why, the message
    how."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = code


class RequestFailedError(RuntimeError):
    """The engine admitted the request and then could not finish it (its remote KV could
    not be loaded under the "fail" policy, or a fault computing it); `code` (pd.errors)
    says which, the message why."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class EngineNotRunningError(EngineDeadError):
    """The engine was not running when the request was to be sent: nothing of it reached
    the engine (so it cannot be what killed it)."""


class _Dead:
    """Put in a request's queue when the engine dies."""


_DEAD = _Dead()


@dataclass
class _EngineProcess:
    """One engine-core process and the sockets and folder the client keeps for it."""

    process: BaseProcess
    context: zmq.Context
    input: zmq.Socket
    output: zmq.asyncio.Socket
    ipc_dir: str
    info: EngineInfo

    @classmethod
    def spawn(cls, config: EngineConfig, startup_timeout: float) -> _EngineProcess:
        """Start the process and wait until it is ready; EngineStartupError if it reports
        a failure, dies or is not ready within `startup_timeout` seconds."""
        ipc_dir = new_ipc_dir()
        input_address, output_address = f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"
        context = zmq.Context()
        input_socket = context.socket(zmq.PUSH)
        input_socket.setsockopt(zmq.SNDHWM, 0)  # a send then fails only when the core is gone
        input_socket.bind(input_address)
        output_socket = zmq.asyncio.Socket(context, zmq.PULL)
        output_socket.setsockopt(zmq.RCVHWM, 0)
        output_socket.bind(output_address)
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, input_address, output_address),
            name="pd-engine-core", daemon=True)
        try:
            process.start()
            info = _wait_ready(process, zmq.Socket.shadow(output_socket.underlying), startup_timeout)
        except BaseException:
            _stop_process(process, timeout=2.0)
            _close(context, input_socket, output_socket, ipc_dir)
            raise
        return cls(process, context, input_socket, output_socket, ipc_dir, info)

    def stop(self, timeout: float) -> None:
        """Ask the process to stop, then terminate / kill it; close the sockets, remove the folder."""
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.input.send(encode(Shutdown()), zmq.NOBLOCK)
        _stop_process(self.process, timeout)
        _close(self.context, self.input, self.output, self.ipc_dir)


class EngineClient:
    """Talks to one engine-core process at a time. Create with `EngineClient.start`."""

    def __init__(self, engine: _EngineProcess, config: EngineConfig | None = None,
                 startup_timeout: float = 120.0) -> None:
        self._engine = engine
        self._config = config  # what `restart` starts again
        self._startup_timeout = startup_timeout
        self._decoder = output_decoder()
        self._stats = engine.info.stats
        self._queues: dict[str, asyncio.Queue[RequestOutput | _Dead]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_error: str | None = None
        self._closed = False
        self.restarts = 0

    # ---- lifecycle ----------------------------------------------------------------

    @classmethod
    def start(cls, config: EngineConfig, startup_timeout: float = 120.0) -> EngineClient:
        """Spawn the engine-core process and wait until it is ready; EngineStartupError
        if it reports a failure, dies or is not ready within `startup_timeout` seconds."""
        return cls(_EngineProcess.spawn(config, startup_timeout), config, startup_timeout)

    async def attach(self) -> None:
        """Start the background tasks in the running loop now (else on first use)."""
        self._attach()

    async def restart(self) -> None:
        """Put a new engine-core process in place of the dead one (its requests have failed
        with EngineDeadError); EngineStartupError if the new one does not start. The new
        one is built in a thread: the server's event loop keeps answering meanwhile. The old
        one is gone first (a core that reported its failure may still be shutting down,
        holding its ports and memory)."""
        if self._config is None or self._closed:
            raise EngineStartupError("this client cannot restart its engine")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self._engine.process.join, RESTART_JOIN_S)
        self._engine.stop(timeout=0.0)  # killed if still there; its sockets closed on this thread
        self._engine = await asyncio.to_thread(_EngineProcess.spawn, self._config, self._startup_timeout)
        self._stats, self._dead_error, self._loop = self._engine.info.stats, None, None
        self.restarts += 1
        self._attach()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait up to `timeout` s, then terminate / kill it. Pending
        requests fail with EngineDeadError. Idempotent; the process is gone afterwards."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                task.cancel()
        self._engine.stop(timeout)
        self._mark_dead("the engine was shut down")

    # ---- state --------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def pid(self) -> int | None:
        return self._engine.process.pid

    @property
    def exitcode(self) -> int | None:
        """The process's exit code (negative: killed by that signal); None while it runs."""
        return self._engine.process.exitcode

    @property
    def is_alive(self) -> bool:
        return self._dead_error is None and self._engine.process.is_alive()

    @property
    def dead_error(self) -> str | None:
        """Why the engine is dead (None while it is alive)."""
        if self._dead_error is None and not self._engine.process.is_alive():
            return _exit_message(self._engine.process)
        return self._dead_error

    @property
    def stats(self) -> EngineStats:
        """The stats sent with the latest step (those at start-up before the first)."""
        return self._stats

    # ---- requests -----------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its outputs (of each of its `n` sequences) until each
        sequence's finished one. RequestRefusedError (a ValueError) if the core refuses it
        or its id is in flight here, RequestFailedError if it fails after admission,
        EngineDeadError if the engine dies. Stopping early (aclose, cancellation) aborts
        the request, every sequence of it, in the core."""
        queue = self._register(request.request_id)
        unfinished = set(request.sequences)
        try:
            self._send(request)
            while unfinished:
                output = await queue.get()
                if isinstance(output, _Dead):
                    raise EngineDeadError(self.dead_error)
                if output.is_refusal:
                    unfinished.clear()
                    raise RequestRefusedError(output.error, output.error_code)
                if output.finished:
                    unfinished.discard(output.index)
                if output.error is not None:
                    raise RequestFailedError(output.error, output.error_code)
                yield output
        finally:
            self._queues.pop(request.request_id, None)
            if unfinished:
                self._abort_quietly([sequence_id(request.request_id, j) for j in range(request.sampling_params.n)])

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests; each one's generator ends with a "abort" output. Unknown or
        finished ids are ignored, and so is everything once the engine is dead."""
        self._attach()
        self._abort_quietly(request_ids)

    async def release_held(self, request_ids: list[str]) -> None:
        """Have a prefill engine free now the blocks it keeps for these finished requests
        (ids it does not hold are ignored, and so is everything once it is dead)."""
        self._send_quietly(ReleaseKV(list(request_ids)))

    async def migrate(self, request_ids: list[str]) -> None:
        """Have the engine hand these requests on with their KV (MigrateRequests): each
        one's generator ends with a "migrated" output per sequence. Ignored once the
        engine is dead."""
        self._send_quietly(MigrateRequests(list(request_ids)))

    # ---- internals ----------------------------------------------------------------

    def _send_quietly(self, message: Any) -> None:
        """Send `message` unless the engine is dead or the client closed (nothing then)."""
        self._attach()
        if self._dead_error is None and not self._closed:
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                self._send(message)

    def _attach(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop or self._closed:
            return
        self._loop = loop
        self._queues = {}  # any left belong to a previous loop, whose tasks are gone
        self._tasks = [loop.create_task(self._read_outputs(), name="pd-engine-outputs"),
                       loop.create_task(self._watch_process(), name="pd-engine-watch")]

    def _register(self, request_id: str) -> asyncio.Queue[RequestOutput | _Dead]:
        self._attach()
        if self._closed or not self.is_alive:
            raise EngineNotRunningError(self.dead_error)
        if request_id in self._queues:
            raise RequestRefusedError(f"request id {request_id!r} is already in flight", INVALID_REQUEST)
        queue: asyncio.Queue[RequestOutput | _Dead] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def _send(self, message: Any) -> None:
        if self._dead_error is not None:
            raise EngineNotRunningError(self._dead_error)
        try:
            self._engine.input.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:  # unbounded queue: only a core that disconnected refuses
            raise EngineNotRunningError("the engine core is not connected") from None

    def _abort_quietly(self, request_ids: list[str]) -> None:
        if self._dead_error is None and not self._closed:
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                self._send(AbortRequests(list(request_ids)))

    async def _read_outputs(self) -> None:
        output = self._engine.output
        try:
            while True:
                message = self._decoder.decode(await output.recv())
                if isinstance(message, StepOutputs):
                    self._route(message)
                elif isinstance(message, EngineFailed):
                    self._mark_dead(f"the engine core failed: {message.error}")
        except Exception as e:  # a broken socket or message: nothing more will arrive
            if not self._closed and output is self._engine.output:
                logger.exception("reading engine outputs failed")
                self._mark_dead(f"reading engine outputs failed: {e!r}")

    def _route(self, message: StepOutputs) -> None:
        self._stats = message.stats
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:  # else its consumer left (and aborted it)
                queue.put_nowait(output)

    async def _watch_process(self) -> None:
        process = self._engine.process
        while process.is_alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
        if process is self._engine.process:
            self._mark_dead(_exit_message(process))

    def _mark_dead(self, reason: str) -> None:
        if self._dead_error is not None:
            return
        self._dead_error = reason
        for queue in self._queues.values():
            queue.put_nowait(_DEAD)


def _wait_ready(process: BaseProcess, socket: zmq.Socket, timeout: float) -> EngineInfo:
    decoder = output_decoder()
    deadline = time.monotonic() + timeout
    while True:
        exited = not process.is_alive()  # checked first: a message sent before exiting is still read
        if socket.poll(500 if exited else 100, zmq.POLLIN):
            message = decoder.decode(socket.recv())
            if isinstance(message, Ready):
                return message.info
            if isinstance(message, StartupFailed):
                raise EngineStartupError(f"engine core failed to start: {message.error}")
            continue
        if exited:
            raise EngineStartupError(f"{_exit_message(process)} before it was ready")
        if time.monotonic() > deadline:
            raise EngineStartupError(f"engine core (pid {process.pid}) not ready after {timeout:g} s")


def _exit_message(process: BaseProcess) -> str:
    return f"engine core process (pid {process.pid}) exited with code {process.exitcode}"


def _stop_process(process: BaseProcess, timeout: float) -> None:
    """Wait for the process to exit, escalating to SIGTERM, then SIGKILL."""
    if process.pid is None:  # never started
        return
    process.join(timeout)
    if process.is_alive():
        logger.warning("engine core (pid %s) did not exit in %g s; terminating", process.pid, timeout)
        process.terminate()
        process.join(KILL_WAIT_S)
    if process.is_alive():
        process.kill()
        process.join()


def _close(context: zmq.Context, input_socket: zmq.Socket, output_socket: zmq.Socket, ipc_dir: str) -> None:
    input_socket.close(linger=0)
    output_socket.close(linger=0)
    context.term()
    shutil.rmtree(ipc_dir, ignore_errors=True)
