"""X prefill and Y decode `pd serve` servers as Ray actors, with `pd proxy` in front.

    python deploy/ray_pd.py --prefill X --decode Y --model DIR [--address auto]
                            [--host 127.0.0.1] [--port 8000] [--policy round_robin]
                            [--num-threads T] [--dtype float32] [--cpus-per-server 0.5]
                            [--ready-timeout 180] [--run-seconds S] [--urls-file F]
                            [--log-dir D] [-- EXTRA pd serve FLAGS]

With `--address` (e.g. `auto`, or `HOST:6379`) it joins a running Ray cluster; without
it, it starts a small local one (no dashboard, a 200 MB object store, one CPU per core).
Every server is one `PDServer` actor: on whichever node Ray places it, the actor picks a
free port and starts `pd serve --role prefill|decode` (NIXL between P and D) bound to the
node's IP (its KV side channel too); this script polls the actors until every server
answers /health (`--ready-timeout` covers placement and start-up). Each actor asks for
`--cpus-per-server` CPUs and, when the cluster has GPUs, one GPU. Every node needs this
project installed in the same Python environment, and the model directory at the same
path. Flags after `--` go to every `pd serve`.

Once every server is up, `pd proxy` runs here on `--host:--port`; the URLs are printed
(and written to `--urls-file` as JSON). Ctrl-C or SIGTERM (or the end of `--run-seconds`)
then stops everything this script started, however it ends (a failed start included):
the proxy, each server (SIGTERM, SIGKILL after 20 s, then whatever is left of its process
group, e.g. an engine process of a server stopped while starting), the actors, and the
local Ray cluster if it started one. Processes are stopped through the handles it holds
(PIDs of its own children, their process groups), never by name; a server whose actor
dies gets SIGTERM from the kernel (parent-death signal). Logs go to `--log-dir` on each
node (default: `$TMPDIR/pd-ray-<pid>`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx
import ray

from pd.kv_transfer_signing import SECRET_ENV
from pd.models.config import SUPPORTED_DTYPES
from proxy.instances import POLICIES

ROLES = ("prefill", "decode")
STOP_TIMEOUT_S = 20.0
GROUP_GRACE_S = 5.0
PROXY_READY_TIMEOUT_S = 60.0
LOCAL_OBJECT_STORE_BYTES = 200 * 1024**2
LOG_TAIL_CHARS = 4000
PR_SET_PDEATHSIG = 1
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# --- helpers shared by the driver and the actors --------------------------------------


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(no log at {path}: {e})"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
                 die_with_parent: bool = False) -> subprocess.Popen:
    """Start `cmd` in its own session (a terminal's Ctrl-C reaches only us), output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preexec = _parent_death_sigterm() if die_with_parent else None
    with open(log_path, "w") as log:
        # preexec only calls prctl(2), resolved beforehand: no locks taken in the child.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=preexec)  # noqa: PLW1509


def _parent_death_sigterm() -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when the thread that started it dies (the main
    thread of an actor, or of this script), so a killed parent orphans no server (Linux)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exited(process: subprocess.Popen) -> bool:
    """Whether `process` has exited. It is left unreaped (a zombie), so its PID, and the
    id of the process group it leads, cannot be reused while we clean up after it."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere: its group id is no longer ours to signal
        process.returncode = -1
        return True


def wait_exited(process: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not exited(process):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def health_ok(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, _, group = entry.joinpath("stat").read_text().rpartition(") ")[2].split()[:3]
                if state != "Z" and int(group) == pgid:
                    members.append(int(entry.name))
    return members


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def end_group(pgid: int, grace: float = GROUP_GRACE_S) -> None:
    """SIGTERM what is left of the group (e.g. an engine its server, stopped while starting,
    left behind), then SIGKILL it after `grace` s."""
    if not group_members(pgid):
        return
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)


def stop_process(process: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM `process` (started in its own session), SIGKILL it after `timeout`, end the
    rest of its process group, then reap it; its exit code."""
    if process.returncode is not None:
        return process.returncode
    if not exited(process):
        # os.kill, not Popen.terminate: that polls first, and could reap the process.
        os.kill(process.pid, signal.SIGTERM)
        if not wait_exited(process, timeout):
            os.kill(process.pid, signal.SIGKILL)
    end_group(process.pid)  # still unreaped, so the group id is still ours
    return process.wait()


# --- the actor ------------------------------------------------------------------------


class PDServer:
    """One `pd serve` subprocess on the node Ray placed this actor on.

    No method blocks for long, so `stop` is served promptly even while the server starts.
    """

    def __init__(self, role: str, index: int, model: str, serve_args: list[str], log_dir: str,
                 transfer_secret: str) -> None:
        self.role, self.index, self.model = role, index, model
        self.serve_args, self.log_dir = serve_args, Path(log_dir)
        self.transfer_secret = transfer_secret  # the deployment's: P signs kv_transfer_params, D checks them
        self.process: subprocess.Popen | None = None
        self.url, self.log_path = "", self.log_dir / f"{role}-{index}.log"
        atexit.register(self.stop)

    def start(self) -> dict[str, Any]:
        """Start the server on a free port of this node; its role, URL, node, port, PID and log."""
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "pd.cli", "serve", "--model", self.model, "--role", self.role,
               "--host", host, "--port", str(port), "--kv-host", host, *self.serve_args]
        env = dict(os.environ) | {SECRET_ENV: self.transfer_secret}  # in the environment: not in `ps`
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.process = start_logged(cmd, self.log_path, env, die_with_parent=True)
        return {"role": self.role, "url": self.url, "node_ip": host, "port": port,
                "pid": self.process.pid, "log": str(self.log_path)}

    def ready(self) -> bool:
        """Whether /health answers 200; raises, with the log's tail, if the server exited."""
        if self.process is not None and exited(self.process):
            code = self.stop()
            raise RuntimeError(f"{self.role} server {self.index} ({self.url}) exited with {code}; "
                               f"log {self.log_path}:\n{log_tail(self.log_path)}")
        return health_ok(self.url)

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, SIGKILL after 20 s); its exit code, None if never started."""
        if self.process is None:
            return None
        return stop_process(self.process)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()


# --- the driver -----------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value:g}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray_pd.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run X prefill and Y decode `pd serve` servers as Ray actors with `pd proxy` in front.",
        epilog="Flags after `--` go to every `pd serve`, e.g. `-- --max-model-len 512`.")
    parser.add_argument("--prefill", type=positive_int, required=True, metavar="X",
                        help="number of prefill servers (at least 1)")
    parser.add_argument("--decode", type=positive_int, required=True, metavar="Y",
                        help="number of decode servers (at least 1)")
    parser.add_argument("--model", type=Path, required=True, metavar="DIR_OR_GGUF",
                        help="HF-format model directory or .gguf file; the same path on every Ray node")
    parser.add_argument("--address", default=None, metavar="ADDR",
                        help="Ray cluster to join, e.g. auto or HOST:6379 (default: start a local one)")
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy listens on (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, metavar="N", help="TCP port of the proxy (default 8000)")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how the proxy picks a prefill and a decode server per request (default round_robin)")
    parser.add_argument("--num-threads", type=positive_int, default=None, metavar="T",
                        help="torch CPU threads per server (default: pd serve's; Ray sets OMP_NUM_THREADS for "
                             "its workers, which the servers inherit)")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float32",
                        help="weights and KV cache dtype of every server (default float32)")
    parser.add_argument("--cpus-per-server", type=positive_float, default=0.5, metavar="N",
                        help="Ray CPUs each server's actor reserves (default 0.5)")
    parser.add_argument("--ready-timeout", type=positive_float, default=180.0, metavar="S",
                        help="seconds the servers may take to be placed and answer /health (default 180)")
    parser.add_argument("--run-seconds", type=positive_float, default=None, metavar="S",
                        help="stop everything after this many seconds (default: run until Ctrl-C / SIGTERM)")
    parser.add_argument("--urls-file", type=Path, default=None, metavar="F",
                        help="write the proxy's and servers' URLs here as JSON once all are healthy")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="D",
                        help="directory for the proxy's and servers' logs, on each node "
                             "(default: $TMPDIR/pd-ray-<this pid>)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags before `--` are ours; those after go to every `pd serve` as `serve_args`."""
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    args.serve_args = argv[split + 1:]
    return args


def serve_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    return flags + args.serve_args


def exit_on_signal(signum: int, frame: Any) -> NoReturn:
    # As SystemExit, SIGTERM / SIGHUP unwind through `main`'s `finally` (the teardown).
    raise SystemExit(0)


def install_signal_handlers() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP until the block ends, then raise KeyboardInterrupt if
    one came: an interrupted ray.init can leave part of a local cluster running. (ray.init
    replaces the SIGTERM handler while it runs, so a SIGTERM then still cuts it short.)"""
    received: list[int] = []
    handlers = {signum: signal.signal(signum, lambda n, _: received.append(n)) for signum in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if received:
        raise KeyboardInterrupt


def connect_ray(address: str | None) -> None:
    with signals_deferred():
        if address is not None:
            ray.init(address=address)
        else:
            # "local": a new cluster, even where `ray start` left one (or its address file) behind.
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES)


def actor_resources(args: argparse.Namespace) -> dict[str, float]:
    """The actor options for one server; raises if the cluster cannot hold them all."""
    count = args.prefill + args.decode
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    if cpus < count * args.cpus_per_server:
        raise RuntimeError(f"the Ray cluster has {cpus:g} CPUs; {count} servers at --cpus-per-server "
                           f"{args.cpus_per_server:g} need {count * args.cpus_per_server:g}")
    if 0 < gpus < count:
        raise RuntimeError(f"the Ray cluster has {gpus:g} GPUs; {count} servers need one each")
    return {"num_cpus": args.cpus_per_server, "num_gpus": 1 if gpus > 0 else 0}


@dataclass
class Deployment:
    """What this script started, for the teardown: each actor (with its `start` result,
    pending or not) and the proxy."""

    starts: dict[Any, ray.ObjectRef] = field(default_factory=dict)
    proxy: subprocess.Popen | None = None


def launch_servers(args: argparse.Namespace, log_dir: Path, deployment: Deployment) -> None:
    """One actor per server, each asked to start its server (placement may wait for resources)."""
    server_cls = ray.remote(PDServer).options(**actor_resources(args))
    model, flags = str(args.model.resolve()), serve_flags(args)
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)  # one per deployment
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for index in range(count):
            actor = server_cls.remote(role, index, model, flags, str(log_dir), secret)
            deployment.starts[actor] = actor.start.remote()


def get_by(refs: list[ray.ObjectRef], deadline: float, late: str) -> list[Any]:
    """ray.get(refs), waiting in 1 s steps (so signals are handled) until `deadline`;
    RuntimeError(late) then. An actor's error is raised as soon as all results are in."""
    pending = refs
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(late)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
    return ray.get(refs)


def wait_for_servers(starts: dict[Any, ray.ObjectRef], timeout: float) -> list[dict[str, Any]]:
    """Each server's info (launch order) once all answer /health; raises if one exits or
    they are not all up within `timeout` s."""
    deadline = time.monotonic() + timeout
    servers = get_by(list(starts.values()), deadline,
                     f"the servers' actors were not all placed within {timeout:g} s: not enough free CPUs/GPUs?")
    pending = dict(zip(starts, servers))
    while pending:
        ready = get_by([actor.ready.remote() for actor in pending], deadline + 5, "a server stopped answering")
        pending = {actor: info for (actor, info), ok in zip(pending.items(), ready) if not ok}
        if pending and time.monotonic() > deadline:
            logs = ", ".join(info["log"] for info in pending.values())
            raise RuntimeError(f"{len(pending)} server(s) not healthy after {timeout:g} s; see {logs}")
        time.sleep(0.5 if pending else 0)
    return servers


def start_proxy(args: argparse.Namespace, servers: list[dict[str, Any]], log_dir: Path) -> subprocess.Popen:
    urls = {role: [s["url"] for s in servers if s["role"] == role] for role in ROLES}
    cmd = [sys.executable, "-m", "pd.cli", "proxy", "--prefill", *urls["prefill"], "--decode", *urls["decode"],
           "--host", args.host, "--port", str(args.port), "--policy", args.policy]
    return start_logged(cmd, log_dir / "proxy.log", die_with_parent=True)


def check_proxy(proxy: subprocess.Popen, log_path: Path) -> None:
    if exited(proxy):
        raise RuntimeError(f"pd proxy exited with {stop_process(proxy)}; log {log_path}:\n{log_tail(log_path)}")


def wait_for_proxy(url: str, proxy: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not health_ok(url):
        check_proxy(proxy, log_path)
        if time.monotonic() > deadline:
            raise RuntimeError(f"pd proxy not healthy after {timeout:g} s; log {log_path}:\n{log_tail(log_path)}")
        time.sleep(0.2)


def write_urls(path: Path, proxy_url: str, servers: list[dict[str, Any]]) -> None:
    """Written whole (via a rename), so a reader never sees half of it."""
    urls = {"proxy": proxy_url, "prefill": [s["url"] for s in servers if s["role"] == "prefill"],
            "decode": [s["url"] for s in servers if s["role"] == "decode"], "servers": servers}
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(urls, indent=2))
    partial.replace(path)


def announce(args: argparse.Namespace, proxy_url: str, servers: list[dict[str, Any]], log_dir: Path) -> None:
    print(f"ray_pd: {args.prefill}P{args.decode}D up on Ray ({args.address or 'local cluster'})")
    print(f"  proxy:   {proxy_url}  (log {log_dir / 'proxy.log'})")
    for s in servers:
        print(f"  {s['role'] + ':':8} {s['url']}  (pid {s['pid']} on {s['node_ip']}, log {s['log']})")
    until = f"for {args.run_seconds:g} s" if args.run_seconds else "until Ctrl-C / SIGTERM"
    print(f"ray_pd: serving {until}; then everything stops", flush=True)


def serve_until_stopped(proxy: subprocess.Popen, run_seconds: float | None, log_path: Path) -> None:
    """Sleep until the time is up or a signal arrives; raise if the proxy dies meanwhile."""
    deadline = time.monotonic() + run_seconds if run_seconds else float("inf")
    while time.monotonic() < deadline:
        check_proxy(proxy, log_path)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def stop_servers(starts: dict[Any, ray.ObjectRef]) -> None:
    """`stop()` every actor that started its server and wait (bounded); then kill every actor."""
    started = [actor for actor, ref in starts.items() if ray.wait([ref], timeout=0)[0]]
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get([actor.stop.remote() for actor in started], timeout=STOP_TIMEOUT_S + GROUP_GRACE_S + 10)
    for actor in starts:  # an actor not placed yet has no server; a killed one SIGTERMs its own
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(actor, no_restart=True)


def teardown(deployment: Deployment) -> None:
    # Bounded in time; a second Ctrl-C must not cut it short and orphan servers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ray_pd: stopping the proxy and every server", flush=True)
    if deployment.proxy is not None:
        stop_process(deployment.proxy)
    if ray.is_initialized():
        stop_servers(deployment.starts)
    ray.shutdown()  # also when ray.init was cut short
    print("ray_pd: stopped everything it started", flush=True)


def run(args: argparse.Namespace, deployment: Deployment) -> None:
    log_dir = args.log_dir or Path(tempfile.gettempdir()) / f"pd-ray-{os.getpid()}"
    connect_ray(args.address)
    launch_servers(args, log_dir, deployment)
    servers = wait_for_servers(deployment.starts, args.ready_timeout)
    deployment.proxy = start_proxy(args, servers, log_dir)
    proxy_url = f"http://{args.host}:{args.port}"
    wait_for_proxy(proxy_url, deployment.proxy, log_dir / "proxy.log", PROXY_READY_TIMEOUT_S)
    if args.urls_file is not None:
        write_urls(args.urls_file, proxy_url, servers)
    announce(args, proxy_url, servers, log_dir)
    serve_until_stopped(deployment.proxy, args.run_seconds, log_dir / "proxy.log")


def describe(error: BaseException) -> str:
    """An actor's own error rather than Ray's wrapping of it (with the remote traceback)."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        return str(error.cause)
    return str(error)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.address is None and not ((args.model / "config.json").is_file() or args.model.suffix == ".gguf"
                                      and args.model.is_file()):
        print(f"ray_pd: no model at {args.model} (neither config.json nor a .gguf file)", file=sys.stderr)
        return 2
    install_signal_handlers()
    deployment = Deployment()
    try:
        run(args, deployment)
    except (KeyboardInterrupt, SystemExit):
        pass
    except (RuntimeError, OSError, ValueError, ray.exceptions.RayError) as e:  # report it, then tear down
        print(f"ray_pd: {describe(e)}", file=sys.stderr)
        return 1
    finally:
        teardown(deployment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
