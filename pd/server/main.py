"""`pd serve`: an engine-core process and the OpenAI-compatible app in front of it.

Flags -> EngineConfig -> EngineClient.start (the engine process) -> uvicorn with the app.
The engine is shut down however the server ends: SIGINT, SIGTERM, a failed bind, an
error. Heavy imports (uvicorn, FastAPI, the engine client) happen only when run, so
building the `pd` parser stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import Any, NoReturn

from launch.ports import listen
from pd.config import ROLES, EngineConfig, add_engine_flags, config_from_args
from pd.config.engine import flat_default
from pd.kv_transfer.connectors import NULL_CONNECTOR
from pd.server.limits import DEFAULT_LIMITS, RequestLimits
from pd.server.registration import DEFAULT_LEASE_S, DRAIN_TIMEOUT_S, Registrar, roles_of
from telemetry import logs, tracing
from telemetry.flags import add_telemetry_flags, apply_telemetry_flags
from wire.fleet import SECRET_ENV

# Idle seconds before the server closes a kept-alive connection: longer than clients keep
# them in their pools (httpx and the openai client: 5 s; the proxy: 2 s), so a client
# never sends on a connection the server is closing at that moment.
KEEPALIVE_S = 30

logger = logging.getLogger("pd.serve")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on; 0: any free one, as the kernel "
                                                               "picks it when the server binds (default 8000)")
    parser.add_argument("--port-file", type=Path, default=None, metavar="PATH",
                        help="write the port listened on to PATH as soon as it is bound, before the engine starts "
                             "(with --port 0, the only way to learn it; a launcher waits for it) (default: none)")
    parser.add_argument("--role", choices=ROLES, default=flat_default("role"),
                        help="both: prefill and decode here; prefill / decode: one side of a "
                             "disaggregated pair behind the proxy (default both)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients must use (default: the model directory's name)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_LIMITS.max_request_bytes,
                        help="largest request body accepted; a larger one is refused with 413 before it is "
                             "read whole (default %(default)s)")
    parser.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_LIMITS.max_sequences, metavar="N",
                        help="the most sequences (n, best_of) one request may ask for (default %(default)s)")
    parser.add_argument("--max-logprobs", type=int, default=DEFAULT_LIMITS.max_logprobs, metavar="K",
                        help="the most alternatives per position (logprobs, top_logprobs) a request may ask for "
                             "(default %(default)s)")
    parser.add_argument("--max-request-tokens", type=int, default=DEFAULT_LIMITS.max_request_tokens, metavar="T",
                        help="the most tokens one request may claim: its sequences times (prompt + max_tokens); "
                             "past it, 400. However big a request, the batch is shared fairly between requests "
                             "(default %(default)s)")
    parser.add_argument("--restart-engine", type=int, default=0, metavar="N",
                        help="when the engine-core process dies (killed, or a crash in native code), start a new "
                             "one, at most N times over the server's life; past that, and with 0, the server "
                             "exits with code 1 so that its supervisor restarts it (default 0)")
    _add_register_flags(parser)
    add_telemetry_flags(parser)


def _add_register_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fleet", "joining a proxy's fleet at runtime (pd/server/registration.py)")
    group.add_argument("--register", nargs="+", default=None, metavar="PROXY_URL",
                       help="join the fleet of each proxy at PROXY_URL once ready (several proxies in front of one "
                            "fleet: each), signed with the deployment's secret ($PD_KV_TRANSFER_SECRET), and renew "
                            "the lease while serving; a proxy takes the server out of routing when renewals stop "
                            "for a lease (default: join no proxy)")
    group.add_argument("--register-lease", type=float, default=DEFAULT_LEASE_S, metavar="S",
                       help="seconds the proxy keeps the server without a renewal; renewed every S/3 "
                            "(default %(default)s)")
    group.add_argument("--register-role", choices=("prefill", "decode"), default=None,
                       help="the role a --role both server asks for when it joins; the proxy's admin API and "
                            "planner may switch it (default: decode; a prefill or decode server: its --role)")
    group.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                       help="on SIGTERM the server drains before it exits: it takes no new request (503 "
                            "server_draining, which the proxy sends elsewhere; a registered server tells its proxy "
                            "at once), hands the proxy's streams on to another decode server with their KV, finishes "
                            "the rest and keeps the blocks a server has yet to read, "
                            "for at most S seconds; a second SIGTERM or SIGINT exits at once; 0: exit at once "
                            "(default %(default)s)")
    group.add_argument("--advertise-url", default=None, metavar="URL",
                       help="the URL the proxy reaches this server at (default: http://--host:--port)")


def _registrar(args: argparse.Namespace, config: EngineConfig) -> Registrar | None:
    """What registers the server with a proxy (`--register`); ValueError for flags that
    cannot (checked before the engine starts)."""
    if args.register is None:
        return None
    roles = roles_of(config.role, config.transfer.connector != NULL_CONNECTOR)
    role = args.register_role or ("decode" if len(roles) > 1 else roles[0])
    if role not in roles:
        raise ValueError(f"--register-role {role}: a --role {config.role} server serves only as {roles[0]}")
    if not config.transfer.secret:
        raise ValueError(f"--register signs the registration with the deployment's secret: set {SECRET_ENV}")
    if args.advertise_url is None and args.host in ("0.0.0.0", "::"):
        raise ValueError(f"--register with --host {args.host}: give --advertise-url, the address the proxy reaches "
                         "this server at")
    return Registrar(tuple(url.rstrip("/") for url in args.register), (args.advertise_url or "").rstrip("/"), roles,
                     role, config.transfer.secret, args.register_lease, tp=config.parallel.size)


def _exit_on_sigterm(signum: int, frame: Any) -> NoReturn:
    # SIGTERM's default kills the process without unwinding, which would orphan the
    # engine core; as SystemExit, the `finally` below shuts it down first.
    raise SystemExit(0)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM; 0 then, 1 if the engine failed to start or died past
    its restarts (pd/server/supervisor.py)."""
    from pd.models.files import check_model
    from pd.tokenizer import Tokenizer

    try:
        config = config_from_args(args).resolve()
        if args.restart_engine < 0:
            raise ValueError(f"--restart-engine must be 0 or more, got {args.restart_engine}")
        registrar = _registrar(args, config)
        limits = RequestLimits(args.max_sequences_per_request, args.max_logprobs, args.max_request_tokens,
                               args.max_request_bytes)
        check_model(config.model.path)
        tokenizer = Tokenizer(config.model.path)
    except (ValueError, OSError) as e:
        raise SystemExit(f"pd serve: {e}") from None
    name = args.served_model_name or config.model.path.resolve().name
    from pd.engine.client import EngineClient, EngineStartupError

    listener = _listen(args.host, args.port, args.port_file)
    args.port = listener.getsockname()[1]  # the one bound: --port 0 asks the kernel
    if registrar is not None and not registrar.url:
        registrar.url = f"http://{args.host}:{args.port}"
    apply_telemetry_flags(args, "pd serve", "pd-serve",
                          {"pd.role": config.role, "pd.instance": f"{args.host}:{args.port}"}, children=True)
    logger.info("dtype %s (%s), quantization %s (%s)", config.model.dtype, config.model.dtype_reason,
                config.model.quantization, config.model.quantization_reason)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    client = None
    try:
        client = EngineClient.start(config)
        info = client.info
        logger.info("KV cache %.2f GiB per rank (%s): %d blocks, %d tokens; KV compatibility hash %s",
                    config.cache.memory / 1024 ** 3, config.cache.memory_reason, info.num_blocks,
                    info.num_blocks * max(info.block_sizes), info.compat_hash[:12])
        for line in client.info.kv_offload:
            logger.info("%s", line)
        if registrar is not None:
            registrar.compat_hash, registrar.engine_pid = info.compat_hash, lambda: client.pid
        if not asyncio.run(_serve(client, tokenizer, name, config, args, listener, limits, registrar)):
            return 1
    except EngineStartupError as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        if client is not None:
            # A second signal must not cut the shutdown short (it is bounded in time).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            client.shutdown()
        listener.close()
        tracing.shutdown()  # what is still queued goes out
    return 0


def _listen(host: str, port: int, port_file: Path | None) -> socket.socket:
    """The server's listening socket, bound before the engine starts (which takes seconds):
    the port is this server's from the moment it was chosen, not taken meanwhile by
    another process's free-port pick, and a port in use fails at once. Its port is
    written to `port_file` now (port 0: the one the kernel picked)."""
    try:
        return listen(host, port, port_file)
    except OSError as e:
        raise SystemExit(f"pd serve: cannot listen on {host}:{port}: {e}") from None


async def _serve(client: Any, tokenizer: Any, name: str, config: EngineConfig, args: argparse.Namespace,
                 listener: socket.socket, limits: RequestLimits, registrar: Registrar | None) -> bool:
    """Serve until stopped; False if stopped because the engine died past its restarts."""
    import uvicorn

    from pd.kv_transfer.signing import TransferParamsGuard
    from pd.server.app import build_app
    from pd.server.chat import ChatTemplate
    from pd.server.drain import DrainingServer
    from pd.server.supervisor import supervise

    template = ChatTemplate.from_model_dir(config.model.path, tokenizer.config)
    app = build_app(client, tokenizer, name, api_key=args.api_key, chat_template=template,
                    role=config.role,
                    transfer_guard=TransferParamsGuard(config.transfer.secret, config.transfer.peer_networks()),
                    limits=limits)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                            log_config=logs.uvicorn_log_config(args.log_format),
                                            timeout_graceful_shutdown=5, timeout_keep_alive=KEEPALIVE_S),
                             app.state.server, registrar, args.drain_timeout)
    ready = asyncio.Event()
    announce = asyncio.create_task(_announce(server, f"http://{args.host}:{args.port}", name, config.role, ready))
    register = asyncio.create_task(registrar.run(ready)) if registrar is not None else None
    engine_gone = []

    def stop() -> None:
        engine_gone.append(True)
        server.should_exit = True

    supervisor = asyncio.create_task(supervise(client, args.restart_engine, stop, app.state.server.engine_restarted))
    try:
        await server.serve(sockets=[listener])
    finally:
        announce.cancel()
        supervisor.cancel()
        if register is not None:
            register.cancel()
            await registrar.send_now("leaving")  # out of the proxy's fleet now, not a lease later
    return not engine_gone


async def _announce(server: Any, url: str, name: str, role: str, ready: asyncio.Event) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("%s (%s) ready at %s (OpenAI API under %s/v1)", name, role, url, url)
    ready.set()

