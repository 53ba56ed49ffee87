"""`python -m benchmarks.fleet_churn --model DIR`: requests through a proxy while its fleet
changes under them, and whether any of them noticed.

A proxy started with no instance, and `--servers` `pd serve --role both --kv-connector
nixl` servers that join it with `--register` (the first as prefill, the others as
decode). `--requests` greedy requests (every other one streamed, completions and chat
alternating; sent again from the first until `--min-changes` changes were made) go
through the proxy, `--concurrency` at a time, while every `--interval` seconds the next
change of the cycle happens:

1. switch: a prefill server and a decode server swap roles (admin API);
2. drain: a decode server is drained (admin API); it is taken back at the next change;
3. leave: a server of the role with most is stopped with SIGTERM (it drains itself and
   leaves the fleet);
4. join: a new server is started and joins by itself, in the role with fewest.

At every moment at least one prefill and one decode server take requests. What is
checked: every answer 200, its token ids those the first server gave for the same
request alone (colocated); every server's KV cache and held blocks back to 0 after.
Prints a JSON summary (requests, failed, mismatched, changes by kind) and exits 1 if
any request failed or differed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import launch
from benchmarks.fleet import wait_registered
from launch import free_port, http_client, pd_command, stop_process

ADMIN_KEY = "fleet-churn"
CHANGES = ("switch", "drain", "leave", "join")
TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_churn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory or GGUF file")
    parser.add_argument("--servers", type=int, default=3, help="servers at the start, at least 3 (default 3)")
    parser.add_argument("--requests", type=int, default=200, help="requests sent in all (default 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between changes (default 10)")
    parser.add_argument("--min-changes", type=int, default=0, metavar="N",
                        help="keep sending the requests again until N changes were made (default 0)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates (default 16)")
    parser.add_argument("--server-args", default="", help="more flags for every server, e.g. '--num-threads 1'")
    parser.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.servers < 3:
        parser.error("--servers must be at least 3: a change must leave a prefill and a decode server serving")
    return args


class Fleet:
    """The servers this run started, and the proxy's view of their roles."""

    def __init__(self, args: argparse.Namespace, workdir: Path, proxy: str, stack: contextlib.ExitStack) -> None:
        self.args, self.workdir, self.proxy, self.stack = args, workdir, proxy, stack
        self.servers: dict[str, launch.Launched] = {}
        self.started = 0
        self.drained: str | None = None

    def start(self, role: str, wait: bool = True) -> launch.Launched:
        port = free_port()
        cmd = pd_command("serve", "--model", str(self.args.model), "--host", "127.0.0.1", "--port", str(port),
                         "--role", "both", "--kv-connector", "nixl", "--register", self.proxy, "--register-role",
                         role, "--register-lease", "5", "--log-level", "warning", *self.args.server_args.split())
        server = launch.start(cmd, f"http://127.0.0.1:{port}", self.workdir / f"server{self.started}.log", wait=wait)
        self.started += 1
        self.stack.callback(stop_process, server.process)
        self.servers[server.url] = server
        return server

    def admin(self, path: str, **body) -> dict:
        response = http_client().request("POST" if body else "GET", f"{self.proxy}/admin/instances{path}",
                                         json=body or None, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                         timeout=10)
        response.raise_for_status()
        return response.json()

    def roles(self) -> dict[str, list[str]]:
        """The URLs taking requests in each role, as the proxy says."""
        taking = {"prefill": [], "decode": []}
        for instance in self.admin("")["instances"]:
            if not instance["draining"] and not instance["leaving"]:
                taking[instance["role"]].append(instance["url"])
        return taking

    def change(self, kind: str) -> str:
        """One change of the cycle; what it did."""
        if self.drained is not None:
            self.admin("/drain", url=self.drained, draining=False)
            self.drained = None
        roles = self.roles()
        if kind == "switch":  # the larger role gives first: neither is ever left without a server
            p, d = roles["prefill"][0], roles["decode"][0]
            moves = [(d, "prefill"), (p, "decode")]
            for url, role in moves if len(roles["decode"]) > 1 else reversed(moves):
                self.admin("/role", url=url, role=role)
            return f"{p} -> decode, {d} -> prefill"
        if kind == "drain":
            most = max(roles, key=lambda r: len(roles[r]))
            self.drained = roles[most][-1]
            self.admin("/drain", url=self.drained)
            return f"{self.drained} ({most}) drained"
        if kind == "leave":
            most = max(roles, key=lambda r: len(roles[r]))
            url = roles[most][-1]
            self.servers.pop(url).process.send_signal(signal.SIGTERM)  # drains itself, then leaves
            return f"{url} ({most}) stopped"
        fewest = min(roles, key=lambda r: len(roles[r]))
        server = self.start(fewest)
        return f"{server.url} joined as {fewest}"


def bodies(n: int, max_tokens: int, chat: bool = True) -> list[tuple[str, dict]]:
    """Request i: (endpoint, body), greedy, every other one streamed, completions and (with
    `chat`) chat in turn."""
    out = []
    for i in range(n):
        text = f"Entry {i % 24}: the keeper of the lighthouse wrote down every ship that passed. " * (1 + i % 3)
        body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if i % 4 < 2 or not chat:
            out.append(("completions", body | {"prompt": text, "stream": i % 2 == 1}))
        else:
            out.append(("chat/completions", body | {"messages": [{"role": "user", "content": text}],
                                                    "stream": i % 2 == 1}))
    return out


def token_ids(url: str, endpoint: str, body: dict) -> tuple[int, list[int] | str]:
    """(status, the answer's token ids) or (status, what went wrong)."""
    try:
        if not body["stream"]:
            response = http_client().post(f"{url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S)
            if response.status_code != 200:
                return response.status_code, response.text[:300]
            return 200, response.json()["choices"][0]["token_ids"]
        ids = []
        with http_client().stream("POST", f"{url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S) as response:
            if response.status_code != 200:
                return response.status_code, response.read().decode(errors="replace")[:300]
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return 200, f"error chunk: {chunk['error']}"
                    ids += chunk["choices"][0].get("token_ids") or []
        return 200, ids
    except Exception as exc:  # noqa: BLE001 - a failed request is a result here
        return 0, f"{type(exc).__name__}: {exc}"


def run(args: argparse.Namespace, workdir: Path) -> dict:
    launch.deployment_secret()
    with contextlib.ExitStack() as stack:
        port = free_port()
        proxy = launch.start(pd_command("proxy", "--host", "127.0.0.1", "--port", str(port), "--admin-key",
                                        ADMIN_KEY),  # its log: every fleet change, with its reason
                             f"http://127.0.0.1:{port}", workdir / "proxy.log", ready=lambda s: s in (200, 503))
        stack.callback(stop_process, proxy.process)
        fleet = Fleet(args, workdir, proxy.url, stack)
        servers = [fleet.start("prefill" if i == 0 else "decode", wait=False) for i in range(args.servers)]
        launch.wait_started(*servers)
        wait_registered(proxy.url, args.servers, ADMIN_KEY)
        chat = token_ids(servers[0].url, "chat/completions", bodies(3, 1)[2][1] | {"stream": False})[0] == 200
        work = bodies(args.requests, args.max_tokens, chat)  # a model without a chat template: completions only
        reference = {}
        for endpoint, body in work:  # each distinct request once, alone, on the first server (colocated)
            if _key(endpoint, body) not in reference:
                reference[_key(endpoint, body)] = token_ids(servers[0].url, endpoint, body | {"stream": False})[1]

        results, changes, elapsed = churned_load(args, fleet, proxy.url, work)
        return summary(work, results, reference, changes, elapsed,
                       {url: kv_left(url) for url in fleet.servers}) | {"chat": chat}


def churned_load(args: argparse.Namespace, fleet: Fleet, proxy: str,
                 work: list[tuple[str, dict]]) -> tuple[list, list, float]:
    """Send `work` through the proxy, `--concurrency` at a time, while the fleet changes
    every `--interval` seconds; past its end, `work` is sent again from its start until
    `--min-changes` changes were made. (request index, answer) pairs, the changes made,
    the seconds it took."""
    done = threading.Event()
    changes: list[tuple[float, str, str]] = []
    results: list[tuple[int, tuple]] = []
    counter = itertools.count()
    lock = threading.Lock()

    def churn() -> None:
        start, k = time.monotonic(), 0
        while not done.wait(args.interval):
            kind = CHANGES[k % len(CHANGES)]
            changes.append((round(time.monotonic() - start, 1), kind, fleet.change(kind)))
            k += 1

    def client() -> None:
        while True:
            with lock:
                n = next(counter)
            if n >= len(work) and len(changes) >= args.min_changes:
                return
            answer = token_ids(proxy, *work[n % len(work)])
            with lock:
                results.append((n % len(work), answer))

    changer = threading.Thread(target=churn, daemon=True)
    started = time.monotonic()
    changer.start()
    try:
        clients = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
    finally:
        done.set()
        changer.join()
    return results, changes, time.monotonic() - started


def summary(work: list, results: list, reference: dict, changes: list, elapsed: float, kv: dict) -> dict:
    failed = [(i, status, answer) for i, (status, answer) in results if status != 200 or isinstance(answer, str)]
    mismatched = [i for i, (status, answer) in results if status == 200 and not isinstance(answer, str)
                  and answer != reference[_key(*work[i])]]
    return {"requests": len(results), "failed": len(failed), "mismatched": len(mismatched),
            "seconds": round(elapsed, 1), "changes": dict(Counter(kind for _, kind, _ in changes)),
            "change_log": changes, "kv_left": kv, "failures": failed[:10], "mismatches": mismatched[:10]}


def _key(endpoint: str, body: dict) -> str:
    return json.dumps([endpoint, body | {"stream": False}], sort_keys=True)


def kv_left(url: str, wait_s: float = 30.0) -> dict[str, float]:
    """The server's KV cache usage and held requests, once both are 0 or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        samples = {}
        for line in http_client().get(f"{url}/metrics", timeout=5).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in ("pd_kv_cache_usage", "pd_kv_requests_held"):
                samples[name] = float(value)
        if not any(samples.values()) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(args, args.workdir or Path(tmp))
    print(json.dumps(summary, indent=1))
    clean = not summary["failed"] and not summary["mismatched"] and not any(
        any(v.values()) for v in summary["kv_left"].values())
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
