"""`pd serve --register PROXY_URL`: the server joins a proxy's fleet and keeps its lease.

Once the server is ready it POSTs a signed `Registration` (`wire/fleet.py`) to the proxy,
then again every `lease_s / RENEWALS_PER_LEASE` seconds: while renewals reach the proxy it
stays in the fleet; when they stop (the server was killed, or cut off) the proxy takes it
out of routing when its lease ends. A proxy that restarted learns it again from the next
renewal. When the server stops it says so (`leaving`), so that the proxy takes it out
once what it sent it has finished, not a lease later.

What it announces: its URL (`--advertise-url`, else its `--host:--port`), the roles it
may serve (a `--role both` server with a KV connector: both, switched by the proxy), the
role it asks for first (`--register-role`), its TP size, engine PID and KV compatibility
hash (a proxy keeps one hash per fleet).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec

from wire.fleet import REGISTER_PATH, SIGNATURE_HEADER, Registration, sign

logger = logging.getLogger("pd.serve")

RENEWALS_PER_LEASE = 3
SEND_TIMEOUT_S = 3.0
DEFAULT_LEASE_S = 10.0
DRAIN_TIMEOUT_S = 10.0  # pd serve --drain-timeout: below the launchers' wait for a stopped server


def roles_of(role: str, has_connector: bool) -> list[str]:
    """The roles a server may be given; ValueError for one that cannot be in a PD fleet."""
    if role != "both":
        return [role]
    if not has_connector:
        raise ValueError("--register: a --role both server joins a PD fleet only with a KV connector "
                         "(--kv-connector nixl), which lets it serve as prefill or decode")
    return ["prefill", "decode"]


@dataclass
class Registrar:
    proxy_url: str
    url: str
    roles: list[str]
    role: str
    secret: str
    lease_s: float = DEFAULT_LEASE_S
    tp: int = 1
    compat_hash: str = ""
    engine_pid: Callable[[], int | None] = lambda: 0  # the engine's PID now (it changes when the engine is restarted)
    state: str = "serving"
    registered: bool = field(default=False, repr=False)  # the proxy took one
    failing: bool = field(default=False, repr=False)  # the last one failed

    def message(self) -> bytes:
        return msgspec.json.encode(Registration(
            url=self.url, roles=self.roles, role=self.role, sent_at=time.time(), lease_s=self.lease_s,
            state=self.state, tp=self.tp, compat_hash=self.compat_hash, engine_pid=self.engine_pid() or 0))

    async def send(self, client: httpx.AsyncClient) -> bool:
        """One registration; whether the proxy took it (failures are logged once per streak)."""
        body = self.message()
        try:
            response = await client.post(self.proxy_url + REGISTER_PATH, content=body, timeout=SEND_TIMEOUT_S,
                                         headers={"Content-Type": "application/json",
                                                  SIGNATURE_HEADER: sign(self.secret, body)})
            ok, why = response.status_code == 200, f"HTTP {response.status_code}: {response.text[:300]}"
        except httpx.HTTPError as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if ok and (self.failing or not self.registered):
            logger.info("registered with the proxy %s as %s (lease %.0f s)", self.proxy_url,
                        response.json().get("role", self.role), self.lease_s)
        elif not ok and not self.failing:
            logger.warning("registration with the proxy %s failed (%s); trying again every %.1f s",
                           self.proxy_url, why, self.lease_s / RENEWALS_PER_LEASE)
        self.failing, self.registered = not ok, self.registered or ok
        return ok

    async def send_now(self, state: str) -> None:
        """A registration with `state` at once (draining, leaving), not at the next renewal."""
        self.state = state
        async with httpx.AsyncClient() as client:
            await self.send(client)

    async def run(self, ready: asyncio.Event) -> None:
        """Register once the server is ready, then renew until cancelled."""
        await ready.wait()
        async with httpx.AsyncClient() as client:
            while True:
                await self.send(client)
                await asyncio.sleep(self.lease_s / RENEWALS_PER_LEASE)
