"""The engine-core process: an EngineCore stepped in a loop behind two ZMQ sockets.

The server (see `client.py`) binds a PUSH socket at `input_address` and a PULL socket at
`output_address`; this process connects to both. It answers `Ready` once the core is
built (or `StartupFailed` and exits 1), then each turn of the loop applies every queued
input message and steps the core if it has work, sending one `StepOutputs` per turn that
produced outputs or changed the stats. SIGTERM, SIGINT, a `Shutdown` message or the death
of the parent process end the loop after the current step; the process then exits 0.

Faults: a request the core refuses, or whose admission or batch fails, is answered with
an error output of its own (see `pd.contracts.outputs` ERROR_*), and the loop goes on. An error
the core cannot pin on a request (the scheduler's or the KV cache's own state) stops
it: the loop sends `EngineFailed` with the reason, and the process exits 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import zmq

from pd.config import EngineConfig
from pd.engine.ipc_messages import (
    AbortRequests,
    EngineFailed,
    EngineInput,
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
    input_decoder,
    refused_request_id,
)
from pd.errors import HeldBlocksLimitError
from telemetry import logs
from wire.codes import INTERNAL_ERROR, INVALID_REQUEST, KV_HELD_LIMIT

if TYPE_CHECKING:
    from pd.engine.core import EngineCore

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle loop blocks on its input, so signals are seen
TRANSFER_POLL_MS = 1  # with only KV transfers in flight: poll them often, without spinning
LINGER_MS = 2000  # how long closing the output socket may wait to deliver what is queued


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The process entry point: exits 0 once stopped, 1 if the core could not be built or
    failed in a way no single request explains. It ends with `os._exit` once its sockets
    have delivered what was queued, its logs are flushed and Python's exit handlers have
    run: tearing down the interpreter with torch and the model loaded takes ~0.5 s more,
    which every stop of the server (and any restart) would wait for."""
    code = 1
    try:
        logs.configure_from_env()  # as `pd serve --log-format` said
        code = _run(config, input_address, output_address)
    except BaseException:
        traceback.print_exc()  # os._exit below would drop what Python prints on the way out
    finally:
        _exit_now(code)


def _run(config: EngineConfig, input_address: str, output_address: str) -> int:
    stop = _StopFlag()
    context = zmq.Context()
    inbox, outbox = _connect(context, input_address, output_address)
    try:
        core = _build_core(config, outbox)
        if core is None:
            return 1
        try:
            outbox.send(encode(Ready(core.info())))
            EngineLoop(core, inbox, outbox, stop).run()
        except Exception as e:
            logger.exception("engine core failed; stopping")
            outbox.send(encode(EngineFailed(f"{type(e).__name__}: {e}")))
            return 1
        finally:
            core.shutdown()
        return 0
    finally:
        inbox.close(linger=0)
        outbox.close(linger=LINGER_MS)
        context.term()


def _exit_now(code: int) -> NoReturn:
    """Exit with `code` after what Python's own exit would do that matters here (exit
    handlers, logs, stdio), skipping the interpreter's teardown."""
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class EngineLoop:
    """Each turn: apply every queued input message, step if there is work, send what
    came of both as one `StepOutputs`."""

    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, stop: _StopFlag) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.stop = stop
        self.decoder = input_decoder()
        self.parent_pid = os.getppid()
        self.last_stats: EngineStats | None = None  # the last sent, without its step counters
        self.ipc_seconds = 0.0  # decoding and applying inputs, encoding and sending outputs (not waiting)
        self.malformed_inputs = 0

    def run(self) -> None:
        while not self.stop.is_set:
            messages = self.receive()
            self.core.check_ranks()
            applying = time.perf_counter()
            outputs = self.apply(messages)
            self.ipc_seconds += time.perf_counter() - applying
            self.core.kv_events.serve_replays()
            stepped = self.core.has_work()
            if stepped:
                outputs += self.core.step()
            sending = time.perf_counter()  # also idle: stats may change without a step (a malformed message)
            self.send(outputs)
            self.ipc_seconds += time.perf_counter() - sending
            if os.getppid() != self.parent_pid:  # orphaned: nobody will read our outputs
                logger.warning("engine core: parent process died, stopping")
                self.stop.set()

    def send(self, outputs: list[RequestOutput]) -> None:
        """The outputs with the stats after them; nothing for a step that changed nothing
        the server sees (a core waiting on remote KV steps without pause)."""
        stats = self.core.stats()
        stats.step_seconds["ipc"] = self.ipc_seconds
        stats.malformed_messages["engine_input"] = self.malformed_inputs
        comparable = stats.without_timing()
        if outputs or comparable != self.last_stats:
            self.outbox.send(encode(StepOutputs(outputs, stats)))
            self.last_stats = comparable

    def receive(self) -> list[EngineInput | Refused]:
        """Every queued message; waits for the first one up to IDLE_POLL_MS when idle, or
        TRANSFER_POLL_MS when only KV transfers are in flight (they progress when polled)."""
        if self.core.has_compute_work():
            timeout = 0
        else:
            timeout = TRANSFER_POLL_MS if self.core.has_work() else IDLE_POLL_MS
        messages = []
        while self.inbox.poll(timeout, zmq.POLLIN):  # the wait is idle time, not messaging
            timeout = 0
            start = time.perf_counter()
            frame = self.inbox.recv()
            try:
                messages.append(self.decoder.decode(frame))
            except Exception as exc:  # any decode failure: answered if it names a request, else dropped
                logger.exception("engine core: a malformed input message")
                self.malformed_inputs += 1
                if (request_id := refused_request_id(frame)) is not None:
                    messages.append(Refused(request_id, f"the request cannot be served: {exc}"))
            self.ipc_seconds += time.perf_counter() - start
        return messages

    def apply(self, messages: list[EngineInput | Refused]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for message in messages:
            if isinstance(message, EngineRequest):
                outputs += self.add(message)
            elif isinstance(message, Refused):
                outputs.append(RequestOutput.refused(message.request_id, message.reason, INVALID_REQUEST))
            elif isinstance(message, AbortRequests):
                aborted = self.core.abort_requests(message.request_ids)
                outputs += aborted
            elif isinstance(message, ReleaseKV):
                self.core.release_held(message.request_ids)
            elif isinstance(message, MigrateRequests):
                outputs += self.core.migrate_requests(message.request_ids)
            elif isinstance(message, Shutdown):
                self.stop.set()
        return outputs

    def add(self, message: EngineRequest) -> list[RequestOutput]:
        """Nothing if the core took the request (each of its sequences, for a resumed
        one); its error output if it refused it (or any sequence of it: those taken
        before are aborted, their outputs dropped)."""
        added: list[str] = []
        try:
            for request in message.to_requests():
                self.core.add_request(request)
                added.append(request.request_id)
            return []
        except HeldBlocksLimitError as e:
            error, code = str(e), KV_HELD_LIMIT
        except ValueError as e:
            error, code = str(e), INVALID_REQUEST
        except Exception as e:  # refused; nothing of it was kept
            logger.exception("adding request %s failed", message.request_id)
            error, code = f"internal error: {type(e).__name__}: {e}", INTERNAL_ERROR
        self.core.abort_requests(added)
        return [RequestOutput.refused(message.request_id, error, code)]


@dataclass(frozen=True)
class Refused:
    """An EngineRequest that did not decode, answered with an error output."""

    request_id: str
    reason: str


class _StopFlag:
    """Set by SIGTERM / SIGINT (and by `Shutdown`); the loop checks it each turn."""

    def __init__(self) -> None:
        self.is_set = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.set()

    def set(self) -> None:
        self.is_set = True


def _connect(context: zmq.Context, input_address: str, output_address: str) -> tuple[zmq.Socket, zmq.Socket]:
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    outbox.connect(output_address)
    return inbox, outbox


def _build_core(config: EngineConfig, outbox: zmq.Socket) -> EngineCore | None:
    """The core, or None after sending `StartupFailed`. Imported here, not at the top,
    so that a failure to import torch or the model code is reported the same way."""
    try:
        from pd.engine.core import EngineCore

        return EngineCore(config)
    except Exception as e:
        logger.exception("engine core failed to start")
        outbox.send(encode(StartupFailed(f"{type(e).__name__}: {e}")))
        return None
