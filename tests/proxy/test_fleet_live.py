"""A fleet at runtime with real servers: a proxy started with no instance, servers that
join it with `--register` (signed, leased), the admin API switching a `--role both`
server's role, draining and removing one, a server killed with SIGKILL taken out when its
lease ends and back by itself once restarted; every answer the colocated one, KV back to 0."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import msgspec
import pytest

from launch import http_client
from launch.ports import free_port
from tests.support.pd_client import complete, stream
from tests.support.server_harness import running_proxy, running_server, wait_until
from wire.fleet import REGISTER_PATH, SECRET_ENV, SIGNATURE_HEADER, Registration, sign

pytestmark = pytest.mark.slow
KEY = "admin-key-of-the-test"
LEASE_S = 3.0
BODY = {"prompt": "The keeper of the lighthouse wrote down every ship. ", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


def admin(front, method: str, path: str = "", key: str | None = KEY, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_client().request(method, f"{front.url}/admin/instances{path}", headers=headers,
                                 json=body or None, timeout=10)


def members(front) -> dict[str, dict]:
    response = admin(front, "GET")
    assert response.status_code == 200, response.text
    return {i["url"]: i for i in response.json()["instances"]}


def roles(front) -> dict[str, str]:
    return {url: i["role"] for url, i in members(front).items()}


@pytest.fixture(scope="module")
def fleet(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models["qwen3"]
    b_port = free_port()
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(logs / "proxy.log", "--admin-key", KEY, "--probe-interval", "1",
                                                  "--breaker-cooldown", "1"))
        empty = http_client().post(f"{front.url}/v1/completions", json=BODY, timeout=10)
        joining = ("--register", front.url, "--register-lease", str(LEASE_S))

        def start(name, *flags, **kw):
            return stack.enter_context(running_server(model, logs / f"{name}.log", *joining, *flags, **kw))

        a = start("a", "--role", "both", "--kv-connector", "nixl", "--register-role", "prefill")
        b = start("b", "--role", "both", "--kv-connector", "nixl", port=b_port)
        c = start("c", "--role", "decode")
        assert wait_until(lambda: roles(front) == {a.url: "prefill", b.url: "decode", c.url: "decode"}, 30), \
            members(front)
        reference = complete(a, BODY).token_ids  # served alone (colocated)
        yield {"proxy": front, "a": a, "b": b, "c": c, "reference": reference, "empty": empty, "model": model,
               "logs": logs, "b_port": b_port, "joining": joining}


def assert_answers(fleet, n: int = 2) -> None:
    for _ in range(n):
        assert complete(fleet["proxy"], BODY).token_ids == fleet["reference"]
        assert stream(fleet["proxy"], BODY).token_ids == fleet["reference"]


def test_a_proxy_with_no_instance_answers_503_no_instance(fleet) -> None:
    assert fleet["empty"].status_code == 503
    assert fleet["empty"].json()["error"]["code"] == "no_instance", fleet["empty"].text
    assert "no decode instance" in fleet["empty"].json()["error"]["message"]


def test_registered_servers_serve_and_roles_switch_in_place(fleet) -> None:
    front, a, b, c = fleet["proxy"], fleet["a"], fleet["b"], fleet["c"]
    assert_answers(fleet)
    listed = members(front)
    assert listed[a.url]["roles"] == ["prefill", "decode"] and listed[c.url]["roles"] == ["decode"]
    assert listed[a.url]["source"] == "registered" and 0 < listed[a.url]["lease_left_s"] <= LEASE_S

    for role_a, role_b in (("decode", "prefill"), ("prefill", "decode")):  # a and b swap roles, and back
        assert admin(front, "POST", "/role", url=b.url, role=role_b).json()["role"] == role_b
        assert admin(front, "POST", "/role", url=a.url, role=role_a).json()["role"] == role_a
        assert_answers(fleet)
        time.sleep(LEASE_S / 2)  # renewals keep the roles the proxy gave
        assert roles(front)[a.url] == role_a and roles(front)[b.url] == role_b

    refused = admin(front, "POST", "/role", url=c.url, role="prefill")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "fixed_role"
    assert "--role decode" in refused.json()["error"]["message"]


def test_a_drained_instance_takes_no_request_and_is_removed_after(fleet) -> None:
    front, b, c = fleet["proxy"], fleet["b"], fleet["c"]
    assert admin(front, "POST", "/drain", url=c.url).json()["draining"] is True
    sent = members(front)[c.url]["requests"]
    assert_answers(fleet)
    time.sleep(LEASE_S / 2)  # a renewal does not undo the drain
    assert members(front)[c.url]["draining"] and members(front)[c.url]["requests"] == sent
    assert admin(front, "POST", "/drain", url=c.url, draining=False).json()["draining"] is False

    assert admin(front, "POST", "/drain", url=b.url).status_code == 200  # c decodes alone now
    assert_answers(fleet, 1)
    assert admin(front, "POST", "/drain", url=b.url, draining=False).status_code == 200
    removed = admin(front, "POST", "/remove", url=c.url)
    assert removed.status_code == 200 and removed.json()["removed"] is True
    assert c.url not in members(front) or members(front)[c.url]["source"] == "registered"  # it may renew back
    assert wait_until(lambda: c.url in members(front), 2 * LEASE_S)  # a running server rejoins by itself
    assert_answers(fleet, 1)


def test_a_killed_server_leaves_with_its_lease_and_rejoins_when_restarted(fleet) -> None:
    front, b = fleet["proxy"], fleet["b"]
    assert roles(front)[b.url] == "decode"
    b.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    b.process.wait(30)
    assert wait_until(lambda: b.url not in members(front), LEASE_S + 5)
    gone_after = time.monotonic() - killed_at
    assert gone_after <= LEASE_S + 1.5, gone_after
    sent = {url: i["requests"] for url, i in members(front).items()}
    assert_answers(fleet)  # a and c serve
    assert sum(i["requests"] for i in members(front).values()) > sum(sent.values())
    changes = admin(front, "GET").json()["changes"]
    assert any(c["url"] == b.url and c["action"] == "expired" for c in changes), changes

    with running_server(fleet["model"], fleet["logs"] / "b-restarted.log", *fleet["joining"], "--role", "both",
                        "--kv-connector", "nixl", port=fleet["b_port"]):
        assert wait_until(lambda: b.url in members(front), 30)
        assert roles(front)[b.url] == "decode"
        assert admin(front, "POST", "/role", url=fleet["a"].url, role="decode").status_code == 200
        assert admin(front, "POST", "/role", url=b.url, role="prefill").status_code == 200
        assert_answers(fleet)  # b (restarted) prefills
        assert admin(front, "POST", "/role", url=b.url, role="decode").status_code == 200
        assert admin(front, "POST", "/role", url=fleet["a"].url, role="prefill").status_code == 200
        with contextlib.suppress(httpx.HTTPError):
            admin(front, "POST", "/drain", url=b.url)
    assert wait_until(lambda: b.url not in members(front), 10)  # stopped: it left at once, not a lease later


def test_the_admin_api_needs_its_key_and_registration_the_secret(fleet) -> None:
    front = fleet["proxy"]
    for key in (None, "wrong", KEY + "x"):
        response = admin(front, "GET", key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert admin(front, "POST", "", url="http://127.0.0.1:1", role="prefill", key=None).status_code == 401
    assert admin(front, "POST", "", url="http://10.0.0.1:80", role="prefill").status_code == 403
    assert admin(front, "POST", "", url="not a url", role="prefill").status_code == 400
    assert admin(front, "POST", "/remove", url="http://127.0.0.1:1").status_code == 404

    body = msgspec.json.encode(Registration(url="http://127.0.0.1:1", roles=["decode"], role="decode",
                                            sent_at=time.time()))
    for signature in ("", "0" * 64, sign("another secret", body)):
        forged = http_client().post(f"{front.url}{REGISTER_PATH}", content=body, timeout=10,
                                    headers={SIGNATURE_HEADER: signature})
        assert forged.status_code == 401, forged.text
    outside = msgspec.json.encode(Registration(url="http://10.0.0.1:8000", roles=["decode"], role="decode",
                                               sent_at=time.time()))
    refused = http_client().post(f"{front.url}{REGISTER_PATH}", content=outside, timeout=10,
                                 headers={SIGNATURE_HEADER: sign(os.environ[SECRET_ENV], outside)})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "address_not_allowed"
    assert "http://127.0.0.1:1" not in members(front) and "http://10.0.0.1:8000" not in members(front)


def test_a_registration_from_outside_the_allowed_networks_is_refused(tmp_path) -> None:
    with running_proxy(tmp_path / "proxy.log", "--fleet-allow", "127.0.0.2/32", "--admin-key", KEY) as front:
        body = msgspec.json.encode(Registration(url="http://127.0.0.2:1", roles=["decode"], role="decode",
                                                sent_at=time.time()))
        response = http_client().post(f"{front.url}{REGISTER_PATH}", content=body, timeout=10,
                                      headers={SIGNATURE_HEADER: sign(os.environ[SECRET_ENV], body)})
        assert response.status_code == 403 and "127.0.0.1" in response.json()["error"]["message"]
        assert members(front) == {}


def test_every_server_holds_no_kv_after(fleet) -> None:
    for name in ("a", "c"):
        server = fleet[name]
        assert wait_until(lambda s=server: s.metrics()["pd_kv_cache_usage"] == 0
                          and s.metrics()["pd_kv_requests_held"] == 0, 60), name


def test_kv_events_are_followed_from_a_join_and_not_after_a_leave(tiny_models, tmp_path) -> None:
    """kv_aware routing reads what a server holds from its KV events: a server added at
    runtime is followed from then on (its index fills as it serves), and one removed is not
    (its index is gone; added again, it is followed anew)."""
    events = ("--kv-events-port", "0")
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", KEY, "--policy", "kv_aware"))
        p = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "p.log", "--role", "prefill", *events))
        d = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "d.log", "--role", "decode", *events))
        for server, role in ((p, "prefill"), (d, "decode")):
            assert admin(front, "POST", url=server.url, role=role).status_code == 201

        def held(url: str) -> int | None:
            index = members(front).get(url, {}).get("kv_index")
            return None if index is None else index["blocks"]

        long = BODY | {"prompt": BODY["prompt"] * 8}
        assert complete(front, long).token_ids
        assert wait_until(lambda: (held(p.url) or 0) > 0 and (held(d.url) or 0) > 0, 30), members(front)
        assert admin(front, "POST", "/remove", url=p.url).json()["removed"] is True
        assert admin(front, "POST", "", url=p.url, role="prefill").status_code == 201
        assert wait_until(lambda: (held(p.url) or 0) > 0, 30)  # a replay of what it holds, followed anew
