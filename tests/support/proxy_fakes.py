"""Fake prefill and decode servers for the proxy's unit tests: small FastAPI apps on
127.0.0.1 (each on a socket bound to a free port before it starts), answering as scripted
and recording what they received. The real servers are tested in tests/pd/server; the
proxy's live tests run it in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from launch import http_client
from proxy.app import build_proxy_app
from proxy.proxy_config import ProxyConfig
from tests.support.server_harness import wait_until  # noqa: F401  (the proxy tests' too)

START_TIMEOUT_S = 10.0
STREAM_CHUNKS = [b'data: {"choices": [{"text": "caf\xc3\xa9"}]}\n\n', b'data: {"choices": [{"text": " ok"}]}\n\n',
                 b"data: [DONE]\n\n"]
COMPLETION = {"id": "cmpl-fake", "object": "text_completion", "choices": [{"index": 0, "text": "fake answer"}]}


@dataclass
class Reply:
    """One scripted answer: `body` is JSON, or bytes sent as they are; None is the
    role's normal answer."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # before answering; a client that leaves meanwhile is counted in `aborted`


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any


def error(code: str, status: int, **headers: str) -> Reply:
    body = {"error": {"message": f"fake {code}", "type": "fake_error", "param": None, "code": code}}
    return Reply(status, body, dict(headers))


class FakeServer:
    """A fake `pd serve`. A prefill server answers with kv_transfer_params naming
    `remote_request_id` "p-<n>"; a decode server with a completion, or the fixed
    `STREAM_CHUNKS` when asked to stream."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.url = ""
        self.replies: list[Reply] = []  # consumed in order, then `default`
        self.default = Reply()
        self.health_status = 200
        self.release_reply: Reply | None = None  # None: {"released": true}
        self.received: list[Received] = []  # completion and chat requests
        self.releases: list[Received] = []
        self.aborted = 0
        self.kv_config: dict[str, Any] | None = None  # GET /v1/kv_config's answer (None: 404)
        self.metrics_text: str | None = None  # GET /metrics's answer (None: 404)

    def app(self) -> FastAPI:
        app = FastAPI()
        app.post("/v1/completions")(self._complete)
        app.post("/v1/chat/completions")(self._complete)
        app.post("/v1/kv/release")(self._release)
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        app.get("/health")(lambda: JSONResponse({"status": self.health_status}, self.health_status))
        app.get("/v1/kv_config")(lambda: JSONResponse(self.kv_config, 200 if self.kv_config else 404))
        app.post("/v1/tokenize")(self._tokenize)
        app.get("/metrics")(lambda: Response(self.metrics_text, 200 if self.metrics_text else 404,
                                             media_type="text/plain"))
        return app

    async def _tokenize(self, request: Request) -> Response:
        """A prompt's characters as its tokens (what `fake_tokens` says)."""
        return JSONResponse({"tokens": fake_tokens(json.loads(await request.body()).get("prompt", ""))})

    @property
    def released_ids(self) -> list[str]:
        return [r.body["remote_request_id"] for r in self.releases]

    async def _complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append(Received(request.url.path, dict(request.headers), body))
        reply = self.replies.pop(0) if self.replies else self.default
        if reply.delay_s and await _client_left_within(request, reply.delay_s):
            self.aborted += 1
            return Response(status_code=499)
        if isinstance(reply.body, bytes):
            return Response(reply.body, reply.status, headers=reply.headers, media_type="application/json")
        if reply.body is not None or reply.status != 200:
            return JSONResponse(reply.body, reply.status, headers=reply.headers)
        if self.role == "prefill":
            return JSONResponse(COMPLETION | {"kv_transfer_params": self.params(len(self.received))})
        if body.get("stream"):
            return StreamingResponse(_chunks(), media_type="text/event-stream")
        return JSONResponse(COMPLETION)

    @staticmethod
    def params(n: int) -> dict[str, Any]:
        return {"do_remote_prefill": True, "remote_engine_id": "fake-engine", "remote_host": "127.0.0.1",
                "remote_port": 1, "remote_request_id": f"p-{n}", "remote_block_ids": [[n]],
                "num_prompt_tokens": 3, "first_token_ids": [7], "block_size": 16}

    async def _release(self, request: Request) -> Response:
        self.releases.append(Received(request.url.path, dict(request.headers), json.loads(await request.body())))
        if self.release_reply is not None:
            return JSONResponse(self.release_reply.body, self.release_reply.status)
        return JSONResponse({"released": True})


def fake_tokens(prompt: str) -> list[int]:
    return [ord(ch) for ch in prompt]


async def _client_left_within(request: Request, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.02)
    return False


async def _chunks() -> AsyncIterator[bytes]:
    for chunk in STREAM_CHUNKS:
        yield chunk
        await asyncio.sleep(0.01)


class _Server(uvicorn.Server):
    """uvicorn's server, checking every 10 ms whether to stop, not every 100 ms: a test
    starts and stops four of them, and waited for each in turn."""

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            await asyncio.sleep(0.01)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """`app` under uvicorn in a thread on a free 127.0.0.1 port: its base URL; always stopped."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), START_TIMEOUT_S)
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def fake(role: str) -> Iterator[FakeServer]:
    server = FakeServer(role)
    with serving(server.app()) as url:
        server.url = url
        yield server


@contextlib.contextmanager
def refusing_port() -> Iterator[str]:
    """A URL whose port is bound but never listens: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


class RawServer:
    """A server on a raw socket (`raw_server`): `url`, and `vanish()`, after which its
    port refuses every connection (a server that died since the proxy's last probe)."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def vanish(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # no longer listening: connections are refused


@contextlib.contextmanager
def raw_server(handle: Callable[[socket.socket, str, bytes], None]) -> Iterator[RawServer]:
    """A server that answers `GET /health` with 200 (the proxy's probes find it up) and
    hands each connection's other first request, read, to `handle(conn, path, body)` (one
    connection at a time, its socket closed after; a connection error ends only that
    connection)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # TimeoutError, ConnectionError among them
                conn, _ = listener.accept()
                with conn:
                    path, body = _read_request(conn)
                    if path == "/health":
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 16\r\n"
                                     b"Connection: close\r\n\r\n{\"status\": \"ok\"}")
                    else:
                        handle(conn, path, body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield RawServer(listener)
    finally:
        stop.set()
        thread.join(START_TIMEOUT_S)
        listener.close()


@contextlib.contextmanager
def hanging_up() -> Iterator[str]:
    """A URL whose server answers /health but reads any other request and then closes the
    connection without answering."""
    with raw_server(lambda conn, path, body: None) as server:
        yield server.url


@contextlib.contextmanager
def vanishing() -> Iterator[RawServer]:
    """A server up when the proxy starts (its probe finds /health answering) whose port
    refuses every connection once the test calls `vanish()`."""
    with raw_server(lambda conn, path, body: None) as server:
        yield server


def _read_request(conn: socket.socket) -> tuple[str, bytes]:
    """One HTTP/1.1 request's path and body (ConnectionError if the client closes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the client")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b" ")[1].decode(), body


@contextlib.contextmanager
def closing_kept_alive(upstream: str) -> Iterator[str]:
    """A URL whose server answers a connection's first request (but /health) as
    `upstream` does (its body relayed) and keeps the connection open, then reads the next
    request on it and closes it unanswered: a server closing an idle connection as a
    request comes."""
    def handle(conn: socket.socket, path: str, body: bytes) -> None:
        answer = http_client().post(upstream + path, content=body, headers={"Content-Type": "application/json"},
                                    timeout=30)
        conn.sendall(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (answer.status_code, len(answer.content)) + answer.content)
        _read_request(conn)  # the next request on the kept-alive connection: closed unanswered

    with raw_server(handle) as server:
        yield server.url


@contextlib.contextmanager
def proxy_in_front(prefill: list[str], decode: list[str], **config: Any) -> Iterator[str]:
    """`build_proxy_app` served in a thread: its base URL. The prober only runs when
    the test sets `probe_interval_s`."""
    config.setdefault("probe_interval_s", 3600.0)
    with serving(build_proxy_app(ProxyConfig(tuple(prefill), tuple(decode), **config))) as url:
        yield url


def proxy_health(url: str) -> dict[str, dict[str, Any]]:
    """The proxy's per-instance state, keyed by instance URL."""
    health = http_client().get(f"{url}/health", timeout=5).json()
    return {i["url"]: i for i in health["prefill"] + health["decode"]}


def proxy_metric(url: str, sample: str, headers: dict[str, str] | None = None) -> float:
    """One sample of the proxy's /metrics, by its name and labels as written."""
    for line in http_client().get(f"{url}/metrics", headers=headers, timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{sample} is not in /metrics")
