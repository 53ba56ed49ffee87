"""`pd serve --register PROXY_URL [PROXY_URL ...]`: the server joins each proxy's fleet and
keeps its lease there.

Once the server is ready it POSTs a signed `Registration` (`wire/fleet.py`) to each proxy,
then again every `lease_s / RENEWALS_PER_LEASE` seconds: while renewals reach a proxy it
stays in that proxy's fleet; when they stop (the server was killed, or cut off) the proxy
takes it out of routing when its lease ends. A proxy that restarted learns it again from
the next renewal. When the server stops it says so (`leaving`), so that each proxy takes
it out once what it sent it has finished, not a lease later. Several proxies in front of
one fleet each keep their own view of it (a role switched through one is that proxy's:
a `--role both` server serves either role whichever proxy sends it a request).

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
    proxy_urls: tuple[str, ...]
    url: str
    roles: list[str]
    role: str
    secret: str
    lease_s: float = DEFAULT_LEASE_S
    tp: int = 1
    compat_hash: str = ""
    engine_pid: Callable[[], int | None] = lambda: 0  # the engine's PID now (it changes when the engine is restarted)
    state: str = "serving"
    registered: set[str] = field(default_factory=set, repr=False)  # proxies that took one
    failing: set[str] = field(default_factory=set, repr=False)  # proxies whose last one failed

    def message(self) -> bytes:
        return msgspec.json.encode(Registration(
            url=self.url, roles=self.roles, role=self.role, sent_at=time.time(), lease_s=self.lease_s,
            state=self.state, tp=self.tp, compat_hash=self.compat_hash, engine_pid=self.engine_pid() or 0))

    async def send(self, client: httpx.AsyncClient) -> bool:
        """One registration to every proxy, at once; whether each took it."""
        body = self.message()
        results = await asyncio.gather(*(self._send_to(client, proxy, body) for proxy in self.proxy_urls))
        return all(results)

    async def _send_to(self, client: httpx.AsyncClient, proxy: str, body: bytes) -> bool:
        """One registration to `proxy`; whether it took it (failures are logged once per streak)."""
        try:
            response = await client.post(proxy + REGISTER_PATH, content=body, timeout=SEND_TIMEOUT_S,
                                         headers={"Content-Type": "application/json",
                                                  SIGNATURE_HEADER: sign(self.secret, body)})
            ok, why = response.status_code == 200, f"HTTP {response.status_code}: {response.text[:300]}"
        except httpx.HTTPError as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if ok and (proxy in self.failing or proxy not in self.registered):
            logger.info("registered with the proxy %s as %s (lease %.0f s)", proxy,
                        response.json().get("role", self.role), self.lease_s)
        elif not ok and proxy not in self.failing:
            logger.warning("registration with the proxy %s failed (%s); trying again every %.1f s",
                           proxy, why, self.lease_s / RENEWALS_PER_LEASE)
        if ok:
            self.failing.discard(proxy)
            self.registered.add(proxy)
        else:
            self.failing.add(proxy)
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
