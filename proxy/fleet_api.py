"""The fleet's routes on the proxy: the admin API and servers' registration (`fleet.py`).

The admin API is on with `--admin-key` (else every admin route answers 403 `admin_off`)
and needs `Authorization: Bearer KEY` (else 401):

- `GET /admin/instances`: every instance (role, roles, draining, leaving, source, lease
  left, load, breaker) and the latest membership changes;
- `POST /admin/instances` `{"url", "role", "roles"?}`: add one (201);
- `POST /admin/instances/drain` `{"url", "draining"?: true}`: drain it, or take it back;
- `POST /admin/instances/remove` `{"url", "force"?: false}`: drain it and take it out
  once nothing is in flight on it (200 out now, 202 once drained);
- `POST /admin/instances/role` `{"url", "role"}`: give it the other role (409 for a
  server with one role);
- `POST /admin/planner/decisions`: a planner's decision (`wire/fleet.py`), kept for the
  dashboard and counted (`pd_proxy_planner_decisions_total{action}`).

Each change may carry a `reason` (kept with it, on the dashboard and in the list).

Registration (`POST /v1/fleet/register`, `wire/fleet.py`) is on with a fleet secret (else
403 `registration_off`); it is refused with 403 from an address outside `--fleet-allow`,
401 without a valid signature, 400 for a body that is not a registration. Bodies are
read up to BODY_LIMIT and decoded into msgspec types; nothing else is accepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from proxy.auth import require_key
from proxy.errors import ProxyError
from proxy.fleet import FleetError, in_networks
from proxy.upstream import Upstream
from wire.body import read_body
from wire.codes import INVALID_REQUEST
from wire.fleet import (
    ADMIN_PATH,
    DECISIONS_PATH,
    REGISTER_PATH,
    SIGNATURE_HEADER,
    PlannerDecision,
    Registration,
    signed_by,
)

T = TypeVar("T")
BODY_LIMIT = 64 * 1024
ADMIN = ADMIN_PATH


class AddInstance(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: str
    roles: list[str] = []
    reason: str = "admin"


class Drain(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    draining: bool = True
    reason: str = "admin"


class Remove(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    force: bool = False
    reason: str = "admin"


class SetRole(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: str
    reason: str = "admin"


def add_fleet_routes(app: FastAPI, upstream: Upstream) -> None:
    fleet, config = upstream.fleet, upstream.config

    @app.get(ADMIN)
    async def list_instances(request: Request) -> JSONResponse:
        _admin(request, config.admin_key)
        state = fleet.state() | {"arrivals": upstream.arrivals, "queue_waiting": upstream.admission.num_waiting}
        return JSONResponse(state, headers={"Cache-Control": "no-store"})

    @app.post(ADMIN)
    async def add(request: Request) -> JSONResponse:
        body = await _decode(request, AddInstance, config.admin_key)
        instance = _changing(lambda: fleet.add(body.url, body.role, tuple(body.roles), reason=body.reason))
        return JSONResponse(instance.state(), status_code=201)

    @app.post(f"{ADMIN}/drain")
    async def drain(request: Request) -> JSONResponse:
        body = await _decode(request, Drain, config.admin_key)
        return JSONResponse(_changing(lambda: fleet.drain(body.url, body.draining, body.reason)).state())

    @app.post(f"{ADMIN}/remove")
    async def remove(request: Request) -> JSONResponse:
        body = await _decode(request, Remove, config.admin_key)
        out = _changing(lambda: fleet.remove(body.url, body.force, body.reason))
        return JSONResponse({"url": body.url.rstrip("/"), "removed": out}, status_code=200 if out else 202)

    @app.post(f"{ADMIN}/role")
    async def set_role(request: Request) -> JSONResponse:
        body = await _decode(request, SetRole, config.admin_key)
        return JSONResponse(_changing(lambda: fleet.set_role(body.url, body.role, body.reason)).state())

    @app.post(DECISIONS_PATH)
    async def decided(request: Request) -> JSONResponse:
        decision = await _decode(request, PlannerDecision, config.admin_key)
        _changing(lambda: fleet.decided(decision))
        upstream.metrics.planner_decisions.labels(action=decision.action).inc()
        return JSONResponse({"kept": True})

    @app.post(REGISTER_PATH)
    async def register(request: Request) -> JSONResponse:
        if config.fleet_secret is None:
            raise ProxyError("registration is off: start the proxy with --fleet-secret (or the deployment's "
                             "secret in its environment)", "registration_off", status=403)
        peer = request.client.host if request.client else ""
        if not in_networks(peer, fleet.networks):
            raise ProxyError(f"registration from {peer or 'an unknown address'} refused: not in the fleet's "
                             "allowed networks (--fleet-allow)", "address_not_allowed", status=403)
        raw = await read_body(request, BODY_LIMIT)
        if not signed_by(config.fleet_secret, raw, request.headers.get(SIGNATURE_HEADER, "")):
            raise ProxyError(f"the registration is not signed with the fleet's secret ({SIGNATURE_HEADER})",
                             "invalid_signature", status=401)
        registration = _parse(raw, Registration)
        instance = _changing(lambda: fleet.register(registration, time.time()))
        return JSONResponse({"url": instance.url, "role": instance.role, "draining": instance.draining,
                             "leaving": instance.url in fleet.leaving})


def _admin(request: Request, admin_key: str | None) -> None:
    if admin_key is None:
        raise ProxyError("the admin API is off: start the proxy with --admin-key", "admin_off", status=403)
    require_key(request, admin_key, "admin key", "admin key")


async def _decode(request: Request, kind: type[T], admin_key: str | None) -> T:
    _admin(request, admin_key)
    return _parse(await read_body(request, BODY_LIMIT), kind)


def _parse(raw: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.MsgspecError, ValueError, UnicodeError) as exc:
        raise ProxyError(f"not a {kind.__name__} body: {exc}", INVALID_REQUEST) from None


def _changing(change: Callable[[], T]) -> T:
    try:
        return change()
    except FleetError as exc:
        raise ProxyError(str(exc), exc.code, status=exc.status) from None
