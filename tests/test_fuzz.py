"""The fuzzer: random and mutated input to every surface of a real PD deployment (a
prefill and a decode server with the NIXL connector, and the proxy in front), with a
fixed budget of examples per surface (Hypothesis), and after each surface the oracle:
the same engine processes, /health 200, a request through the proxy answered with the
tokens it was answered before, and the KV caches back to 0.

Surfaces: every HTTP route of `pd serve` (on P and D) and of `pd proxy`, with bodies
that are random JSON, valid bodies with a field mutated, or random bytes, and W3C trace
headers well formed or not (tracing is on, exporting to a receiver of the test's); the KV events
replay socket and the KV side channel (ZMQ DEALER frames: random, and mutated valid
messages, among them msgpack maps whose keys are not UTF-8); NIXL notifications to P
(from a NIXL agent of our own, after a handshake as any decode server makes); and
random bytes on every TCP port; the tensor-parallel join listener (a listener as a server
with ranks on other nodes opens while it starts: frames random and mutated, framed and
not). A server answers a bad request with a 4xx, never a
5xx (but 503 `kv_held_limit`); nothing received stops an engine.

Every new route, listener or message type is added here (docs/architecture.md, Testing).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_events.messages import ReplayRequest, encode
from launch import http_client
from tests.support.otlp import otlp_receiver
from tests.support.server_harness import running_proxy, running_server, wait_until
from wire.fleet import DECISIONS_PATH, REGISTER_PATH, SECRET_ENV, SIGNATURE_HEADER, sign

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
BUDGET = {"server_http": 500, "proxy_http": 300, "fleet_http": 300, "replay": 400, "side_channel": 300, "tcp": 200,
          "nixl": 300, "tp_join": 300, "tp_join_rank": 200}
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=False)


def budget(surface: str) -> settings:
    return settings(FUZZ, max_examples=BUDGET[surface])
ADMIN_KEY = "fuzz-admin-key"
PROMPT = "The keeper of the lighthouse wrote down every ship. "
REFERENCE_BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
SERVER_FLAGS = ("--max-model-len", "128", "--max-sequences-per-request", "4", "--kv-lease-seconds", "5",
                "--kv-digest", "--log-level", "warning")


@pytest.fixture(scope="module")
def deployment(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        endpoint, _ = stack.enter_context(otlp_receiver())  # traced: the traceparent headers below are read
        traced = ("--otlp-traces-endpoint", endpoint)
        p = stack.enter_context(running_server(
            tiny_models["qwen3"], logs / "p.log", "--role", "prefill", *SERVER_FLAGS, *traced, "--kv-events-port",
            "0"))  # every port bound as the kernel picks it: what P says it bound is read below
        d = stack.enter_context(running_server(tiny_models["qwen3"], logs / "d.log", "--role", "decode",
                                               *SERVER_FLAGS, *traced))
        proxy = stack.enter_context(running_proxy(logs / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  "--log-level", "warning", "--timeout", "30", "--admin-key",
                                                  ADMIN_KEY, *traced))
        reference = answer(proxy)
        pids = {name: engine_pid(server) for name, server in (("p", p), ("d", d))}
        ports = bound_ports(p)
        yield {"p": p, "d": d, "proxy": proxy, "ports": ports, "reference": reference, "pids": pids}


def bound_ports(p) -> dict[str, int]:
    """P's KV events, replay and side-channel ports, as it says it bound them."""
    events = http_client().get(f"{p.url}/v1/kv_config", timeout=10).json()["events"]
    params = http_client().post(f"{p.url}/v1/completions", json=REFERENCE_BODY | {
        "kv_transfer_params": {"do_remote_decode": True}}, timeout=60).json()["kv_transfer_params"]
    http_client().post(f"{p.url}/v1/kv/release", json={"remote_request_id": params["remote_request_id"],
                                                       "signature": params["signature"]}, timeout=10)
    port = lambda endpoint: int(endpoint.rsplit(":", 1)[1])  # noqa: E731
    return {"events": port(events["publisher"]), "replay": port(events["replay"]), "side": params["remote_port"]}


def engine_pid(server) -> int:
    health = server.health()
    assert health.status_code == 200, health.text
    return health.json()["engine_pid"]


def answer(proxy) -> str:
    response = http_client().post(f"{proxy.url}/v1/completions", json=REFERENCE_BODY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_unharmed(deployment) -> None:
    """The oracle: same engines, healthy, answering as before, KV back to 0."""
    for name in ("p", "d"):
        assert engine_pid(deployment[name]) == deployment["pids"][name], f"{name}'s engine is another process"
    assert deployment["proxy"].health().status_code == 200
    assert answer(deployment["proxy"]) == deployment["reference"]
    for name in ("p", "d"):
        server = deployment[name]

        def drained(s=server) -> bool:
            return s.metrics()["pd_kv_cache_usage"] == 0 and s.metrics()["pd_kv_requests_held"] == 0

        assert wait_until(drained, 60), f"{name} keeps KV: {server.metrics()['pd_kv_cache_usage']}"


# ---- strategies --------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "stream",
          "stream_options", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_tokens", "ignore_eos", "response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "tools", "tool_choice", "kv_transfer_params", "cache_salt", "model",
          "priority", "remote_request_id", "signature", "return_token_ids", "chat_template_kwargs", "resume"]
VALID = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
    "/v1/tokenize": {"prompt": PROMPT},
    "/v1/kv/release": {"remote_request_id": "cmpl-x"},
}
SPECIAL = st.sampled_from([
    {"do_remote_decode": True}, {"do_remote_prefill": True}, {"do_remote_prefill": True, "remote_port": 0},
    {"do_remote_decode": True, "prefix": {"do_remote_prefill": True}}, {"do_remote_decode": True, "prefix": [1]},
    {"do_remote_decode": True, "prefix": {
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 9,
        "remote_request_id": "r", "remote_block_ids": [[1]], "num_prompt_tokens": 1, "first_token_ids": [5],
        "block_size": 16}},
    *({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 9,
       "remote_request_id": "r", "remote_block_ids": [[1]], "num_prompt_tokens": 1, "first_token_ids": [5],
       "block_size": 16} | extra
      for extra in ({"kv_digests": ["AAAAAAAAAAA="]}, {"kv_digests": ["not base64!"]}, {"kv_digests": []},
                    {"kv_digests": [1, 2]}, {"prompt_sources": {"computed": 1, "disk": 2**40}},
                    {"prompt_sources": {"elsewhere": 1}}, {"prompt_sources": [1]})),
    {"token_ids": [1, 2]}, {"token_ids": [1, 2], "text_chars": -1}, {"token_ids": [2**40], "text_chars": 2**63},
    {"token_ids": [5] * 64, "text_chars": 3}, {"token_ids": []}, {"text_chars": 1},  # resume
    {"choices": [{"token_ids": [1, 2], "kv_transfer_params": {"do_remote_prefill": True}}]},  # resume, handed on
    {"choices": [{"token_ids": [1], "kv_transfer_params": [1]}]}, {"choices": [{"kv_transfer_params": {}}]},
    {"choices": [{"token_ids": [3, 4], "finish_reason": "stop", "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 1,
        "remote_request_id": "r", "remote_block_ids": [[1]], "num_prompt_tokens": 1, "first_token_ids": [4],
        "block_size": 16}}]},
    "\udcff", "\x00" * 10, 2**63, -1, float("nan"), float("inf"), [[]], {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}, {"grammar": "start: start"},
])


@st.composite
def mutated(draw, path: str) -> dict:
    """A valid body for `path` with fields set to random or special values."""
    body = dict(VALID.get(path, {}))
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(FIELDS))] = draw(json_values | SPECIAL)
    return body


HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=120).map(str.strip)  # as sent
trace_headers = st.fixed_dictionaries({}, optional={  # W3C trace context, well formed or not
    "traceparent": HEADER_TEXT | st.builds("00-{}-{}-{}".format, st.binary(min_size=16, max_size=16).map(bytes.hex),
                                           st.binary(min_size=8, max_size=8).map(bytes.hex),
                                           st.sampled_from(["00", "01", "ff", "zz"])),
    "tracestate": HEADER_TEXT})


def http_body(path: str):
    as_json = (mutated(path) | json_values).map(lambda v: json.dumps(v).encode())
    return as_json | st.binary(max_size=300)


SERVER_ROUTES = [("POST", p) for p in VALID] + [("GET", p) for p in ("/v1/models", "/v1/kv_config", "/health",
                                                                     "/metrics", "/v1/nothing")]
PROXY_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                ("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/kv/release"), ("GET", "/dashboard"),
                ("GET", "/dashboard/state")]


def send(url: str, method: str, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return http_client().request(method, url + path, content=content, timeout=60,
                                 headers={"Content-Type": "application/json"} | (headers or {}))


def assert_no_server_error(response: httpx.Response) -> None:
    if response.status_code == 503:
        assert "kv_held_limit" in response.text or "engine" not in response.text, response.text
        return
    assert response.status_code < 500, response.text[:500]


# ---- HTTP ----------------------------------------------------------------------------


def test_every_route_of_the_servers(deployment) -> None:
    @budget("server_http")
    @given(data=st.data(), role=st.sampled_from(["p", "d"]), route=st.sampled_from(SERVER_ROUTES))
    def fuzz(data, role, route) -> None:
        method, path = route
        assert_no_server_error(send(deployment[role].url, method, path, data.draw(http_body(path)),
                                    data.draw(trace_headers)))

    fuzz()
    assert_unharmed(deployment)


def test_every_route_of_the_proxy(deployment) -> None:
    @budget("proxy_http")
    @given(data=st.data(), route=st.sampled_from(PROXY_ROUTES))
    def fuzz(data, route) -> None:
        method, path = route
        response = send(deployment["proxy"].url, method, path, data.draw(http_body(path)), data.draw(trace_headers))
        assert response.status_code < 500 or response.status_code == 503 and "kv_held_limit" in response.text, \
            response.text[:500]

    fuzz()
    assert_unharmed(deployment)


FLEET_ROUTES = [("GET", "/admin/instances"), ("POST", "/admin/instances"), ("POST", "/admin/instances/drain"),
                ("POST", "/admin/instances/remove"), ("POST", "/admin/instances/role"), ("POST", REGISTER_PATH),
                ("POST", DECISIONS_PATH)]
STRANGER = "http://127.0.0.1:9"  # no server: what a valid body names (never the deployment's P or D)
FLEET_VALID = {
    "/admin/instances": {"url": STRANGER, "role": "decode", "roles": ["prefill", "decode"]},
    "/admin/instances/drain": {"url": STRANGER, "draining": True},
    "/admin/instances/remove": {"url": STRANGER, "force": True},
    "/admin/instances/role": {"url": STRANGER, "role": "prefill"},
    DECISIONS_PATH: {"action": "hold", "reason": "fuzz", "url": STRANGER, "role": "prefill", "inputs": {"x": 1}},
    REGISTER_PATH: {"url": STRANGER, "roles": ["decode"], "role": "decode", "sent_at": 0.0, "lease_s": 10.0,
                    "state": "serving", "tp": 1, "compat_hash": "", "engine_pid": 1},
}
FLEET_SPECIAL = st.sampled_from([STRANGER, "http://127.0.0.1:0", "http://[::1]:9", "http://10.0.0.1:9", "", "prefill",
                                 "decode", "both", ["prefill", "prefill"], [], "leaving", "draining", 1e308, -1,
                                 2**64, "\udcff", "http://127.0.0.1:9/v1?x#y"])


@st.composite
def fleet_body(draw, path: str) -> bytes:
    """A fleet route's body: valid with fields mutated (a registration's sent_at now), random
    JSON or random bytes."""
    kind = draw(st.sampled_from(["mutated", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    body = dict(FLEET_VALID.get(path, {})) | ({"sent_at": time.time()} if path == REGISTER_PATH else {})
    for _ in range(draw(st.integers(0, 3))):
        body[draw(st.sampled_from([*body, "extra"] or ["url"]))] = draw(json_values | FLEET_SPECIAL)
    return json.dumps(body).encode()


def test_the_fleet_routes_of_the_proxy(deployment) -> None:
    """The admin API (with its key, a wrong one or none) and registration (signed with the
    deployment's secret or not): no 5xx; after, what joined is taken out and P and D serve."""
    proxy, secret = deployment["proxy"], os.environ[SECRET_ENV]

    @budget("fleet_http")
    @given(data=st.data(), route=st.sampled_from(FLEET_ROUTES), key=st.sampled_from([ADMIN_KEY, None, "wrong"]),
           signed=st.booleans())
    def fuzz(data, route, key, signed) -> None:
        method, path = route
        content = data.draw(fleet_body(path))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if path == REGISTER_PATH and signed:
            headers[SIGNATURE_HEADER] = sign(secret, content)
        response = send(proxy.url, method, path, content, headers)
        assert response.status_code < 500, response.text[:500]

    fuzz()
    joined = deployment["proxy"].metrics()['pd_proxy_fleet_changes_total{action="joined"}']
    assert joined > 0  # the fuzzer's bodies went as far as changing the fleet
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    fleet = http_client().get(f"{proxy.url}/admin/instances", headers=admin, timeout=10).json()["instances"]
    for instance in fleet:
        if instance["url"] not in (deployment["p"].url, deployment["d"].url):
            http_client().post(f"{proxy.url}/admin/instances/remove", json={"url": instance["url"], "force": True},
                               headers=admin, timeout=10).raise_for_status()
        else:
            http_client().post(f"{proxy.url}/admin/instances/drain", json={"url": instance["url"], "draining": False},
                               headers=admin, timeout=10).raise_for_status()
    roles = {i["url"]: i["role"] for i in
             http_client().get(f"{proxy.url}/admin/instances", headers=admin, timeout=10).json()["instances"]}
    assert roles == {deployment["p"].url: "prefill", deployment["d"].url: "decode"}
    assert_unharmed(deployment)


# ---- ZMQ and TCP listeners -----------------------------------------------------------


@st.composite
def msgpack_like(draw, valid: bytes) -> bytes:
    """Bytes that are almost the valid message: flipped, cut, grown, or a map whose keys
    are arbitrary bytes (not UTF-8: msgspec raises UnicodeDecodeError for them)."""
    kind = draw(st.sampled_from(["flip", "cut", "grow", "map", "random"]))
    if kind == "flip":
        at = draw(st.integers(0, len(valid) - 1))
        return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1:]
    if kind == "cut":
        return valid[:draw(st.integers(0, len(valid) - 1))]
    if kind == "grow":
        return valid + draw(st.binary(min_size=1, max_size=20))
    if kind == "map":
        keys = draw(st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=3))
        return bytes([0x80 | len(keys)]) + b"".join(bytes([0xa0 | len(k)]) + k + b"\x01" for k in keys)
    return draw(st.binary(max_size=200))


def zmq_frames(valid: bytes):
    return st.lists(msgpack_like(valid) | st.binary(max_size=64), min_size=1, max_size=3)


def fuzz_socket(port: int, valid: bytes, examples: int, envelope: bool) -> None:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        @settings(FUZZ, max_examples=examples)
        @given(frames=zmq_frames(valid))
        def fuzz(frames) -> None:
            dealer.send_multipart(([b""] if envelope else []) + frames)
            while dealer.poll(0):
                dealer.recv_multipart()  # whatever it answers: read, so replies never back up

        fuzz()
        time.sleep(0.5)
    finally:
        dealer.close()
        context.term()


def test_the_kv_events_replay_socket(deployment) -> None:
    fuzz_socket(deployment["ports"]["replay"], encode(ReplayRequest(1)), BUDGET["replay"], envelope=False)
    assert wait_until(lambda: deployment["p"].metrics()['pd_malformed_messages_total{listener="kv_events_replay"}'] > 0)
    assert_unharmed(deployment)


def test_the_kv_side_channel(deployment) -> None:
    from connectors.nixl.handshake import handshake_request
    from connectors.nixl.peer_messages import encode as encode_handshake
    from pd.kv_transfer.signing import handshake_key, secret_from_env

    valid = encode_handshake(handshake_request("pd-fuzzer", "0" * 64, handshake_key(secret_from_env())))
    fuzz_socket(deployment["ports"]["side"], valid, BUDGET["side_channel"], envelope=True)
    assert wait_until(lambda: deployment["p"].metrics()['pd_malformed_messages_total{listener="side_channel"}'] > 0)
    assert_unharmed(deployment)


def test_random_bytes_on_every_tcp_port(deployment) -> None:
    ports = [*deployment["ports"].values()] + [int(deployment[n].url.rsplit(":", 1)[1]) for n in ("p", "d", "proxy")]

    @budget("tcp")
    @given(port=st.sampled_from(ports), payload=st.binary(min_size=1, max_size=2000))
    def fuzz(port, payload) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(payload)

    fuzz()
    assert_unharmed(deployment)


def test_the_tensor_parallel_join_listener() -> None:
    """Each connection is refused and closed, nothing joins, and the awaited rank joins after."""
    from pd.worker.rank_channel import ENCODER, HEADER, Hello
    from pd.worker.rank_join import RankListener, join

    secret = "s" * 64
    listener = RankListener("127.0.0.1", 0, secret, {1})
    valid = ENCODER.encode(Hello(1, b"n" * 32, b"m" * 32))
    try:
        @budget("tp_join")
        @given(payload=msgpack_like(valid), framed=st.booleans())
        def fuzz(payload, framed) -> None:
            with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as raw, \
                    contextlib.suppress(OSError):  # closed with bytes unread: a reset
                raw.sendall(HEADER.pack(len(payload)) + payload if framed else payload)
                raw.shutdown(socket.SHUT_WR)
                while raw.recv(4096):  # until the listener closes it
                    pass

        fuzz()
        assert not listener.joined and listener.refused >= BUDGET["tp_join"]
        channel = join("127.0.0.1", listener.port, 1, secret, timeout=10)
        assert list(listener.wait(10, lambda: None)) == [1]
        channel.close()
    finally:
        listener.close()


def test_a_rank_joining_an_engine_that_answers_garbage() -> None:
    """What an engine says to a joining rank (its challenge, then a welcome or a refusal),
    mutated: the rank's join ends in a ChannelError saying so, never another exception."""
    from pd.worker.rank_channel import ENCODER, HEADER, Challenge, ChannelError, Refused, Welcome
    from pd.worker.rank_join import join

    challenge = ENCODER.encode(Challenge(b"n" * 32))
    answers = [ENCODER.encode(Welcome(b"m" * 32)), ENCODER.encode(Refused("no"))]
    with socket.create_server(("127.0.0.1", 0)) as engine:
        port = engine.getsockname()[1]

        @budget("tp_join_rank")
        @given(first=st.booleans(), answer=st.sampled_from(answers).flatmap(msgpack_like), framed=st.booleans())
        def fuzz(first, answer, framed) -> None:
            frame = HEADER.pack(len(answer)) + answer if framed else answer
            replies = [frame] if first else [HEADER.pack(len(challenge)) + challenge, frame]
            serving = threading.Thread(target=answer_once, args=(engine, replies), daemon=True)
            serving.start()
            with pytest.raises(ChannelError):
                join("127.0.0.1", port, 1, "s" * 64, timeout=0)  # one try
            serving.join(10)

        fuzz()


def answer_once(listener: socket.socket, replies: list[bytes]) -> None:
    """Send each reply, the next after the rank's hello, then close."""
    conn, _ = listener.accept()
    with conn, contextlib.suppress(OSError):
        for i, reply in enumerate(replies):
            if i:
                conn.recv(4096)  # the rank's hello (or the end)
            conn.sendall(reply)


# ---- NIXL notifications --------------------------------------------------------------

NOTIFIER = r"""
import struct, sys, time
from connectors.nixl.handshake import fetch_remote_layout, handshake_request
from pd.kv_transfer.nixl_api import load_nixl
from pd.kv_transfer.signing import handshake_key, secret_from_env
from connectors.nixl.ucx import configure_ucx

configure_ucx("127.0.0.1")
port, compat = int(sys.argv[1]), sys.argv[2]
api, _ = load_nixl()
agent = api.nixl_agent("pd-fuzzer", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
request = handshake_request("pd-fuzzer", compat, handshake_key(secret_from_env()))
response = fetch_remote_layout("127.0.0.1", port, request, 10.0)
peer = agent.add_remote_agent(response.agent_metadata)
print("ready", flush=True)
stdin = sys.stdin.buffer
while header := stdin.read(4):
    payload = stdin.read(struct.unpack("<I", header)[0])
    agent.send_notif(peer, payload)
    agent.get_new_notifs()
end = time.monotonic() + 3
while time.monotonic() < end:  # without a progress thread, sends move while we poll
    agent.get_new_notifs()
    time.sleep(0.001)
"""


def test_nixl_notifications_to_the_prefill_server(deployment) -> None:
    import struct

    from connectors.nixl.peer_messages import KeepAlive, ReadDone, Reject, encode_notif

    p = deployment["p"]
    compat = http_client().get(f"{p.url}/v1/kv_config", timeout=10).json()["compat_hash"]
    sender = subprocess.Popen([sys.executable, "-c", NOTIFIER, str(deployment["ports"]["side"]), compat],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert sender.stdout.readline().strip() == b"ready"
        # P polls NIXL while it holds blocks for a decode server (and for a while after): an idle P
        # receives nothing, as it needs nothing. Hold one under the lease while the fuzzer sends,
        # from when the sender is ready (its start took longer than P's 5 s lease on a loaded run).
        held = http_client().post(f"{p.url}/v1/completions", timeout=60,
                                  json=REFERENCE_BODY | {"kv_transfer_params": {"do_remote_decode": True}})
        assert held.status_code == 200, held.text
        valid = [encode_notif(n) for n in (ReadDone("cmpl-1"), Reject("cmpl-2", "why"), KeepAlive("cmpl-3"))]

        @budget("nixl")
        @given(data=st.data())
        def fuzz(data) -> None:
            payload = data.draw(msgpack_like(data.draw(st.sampled_from(valid))))
            sender.stdin.write(struct.pack("<I", len(payload)) + payload)

        fuzz()
        sender.stdin.close()
        assert sender.wait(60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            sender.kill()
    label = 'pd_malformed_messages_total{listener="nixl_notification"}'
    assert wait_until(lambda: p.metrics()[label] > 0)
    assert_unharmed(deployment)
