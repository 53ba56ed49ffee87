"""The proxy's part in the simulation, made of the proxy's own pieces: its instance pools
(`proxy/instances.py`: the pick by `--policy`, the count of requests in flight and of
prompt tokens to work through on each instance), its choice of where a prompt is
computed (`proxy/disagg.py`) and the role switch of its fleet (`proxy/fleet.py`), kept in
the same order as `proxy/forward.py` and `proxy/upstream.py` keep them:

1. the decode server is picked and bound to the request;
2. the path is chosen (`always`: a prefill server; `conditional`: D itself when it lacks
   at most `--local-prefill-max-tokens`, or when the least loaded P has more queued);
3. P is picked, computes the prompt, answers; then the request goes to its D, or to
   another D if its D left the decode role meanwhile;
4. D's answer ends: the request is no longer in flight there.

The servers' KV events are not simulated (no prefix is known to be held anywhere), so a
prompt's tokens are all to be computed and kv_aware picks by load alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.disagg import LOCAL, choose_path
from proxy.instances import Instance, InstancePool, Route
from proxy.proxy_config import ProxyConfig

ROLES = ("prefill", "decode")


@dataclass
class Call:
    """A request as the proxy holds it: its route, the servers it was sent to, and the
    tokens counted against each."""

    route: Route
    prompt: int
    decode: Instance | None = None  # bound, then sent to
    bound: Instance | None = None
    prefill: Instance | None = None
    prefill_work: int = 0
    decode_work: int = 0


@dataclass
class SimProxy:
    config: ProxyConfig
    prefill: InstancePool = field(init=False)
    decode: InstancePool = field(init=False)
    arrivals: int = 0

    def __post_init__(self) -> None:
        both = ROLES
        self.prefill = InstancePool([Instance(u, "prefill", roles=both) for u in self.config.prefill_urls], "prefill",
                                    self.config.role_policy("prefill"), load_slack=self.config.load_slack)
        self.decode = InstancePool([Instance(u, "decode", roles=both) for u in self.config.decode_urls], "decode",
                                   self.config.role_policy("decode"), decode_load_tokens=self.config.decode_load_tokens,
                                   load_slack=self.config.load_slack)

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefill.instances, *self.decode.instances]

    def arrive(self, key: str, prompt: int) -> Call:
        """A request reaches the proxy: its D picked and bound."""
        self.arrivals += 1
        call = Call(Route(key, [0] * prompt if self.config.needs_tokens else None), prompt)
        call.decode = self.decode.pick(call.route)
        call.bound = call.decode
        call.decode.bound += 1
        return call

    def disaggregated(self, call: Call) -> bool:
        """Whether a prefill server computes the prompt (else D does, itself)."""
        return choose_path(call.route, call.decode, self.prefill, self.config.disagg_policy,
                           self.config.local_prefill_max_tokens, 0) != LOCAL

    def send_prefill(self, call: Call) -> Instance:
        call.prefill = self.prefill.pick(call.route)
        call.prefill_work = call.prefill.lacking_tokens(call.route) or 0
        call.prefill.outstanding += 1
        call.prefill.outstanding_tokens += call.prefill_work
        call.prefill.requests += 1
        return call.prefill

    def prefilled(self, call: Call) -> None:
        """P answered."""
        call.prefill.outstanding -= 1
        call.prefill.outstanding_tokens -= call.prefill_work

    def open_decode(self, call: Call) -> Instance:
        """The D the request is sent to: its own, unless it left the decode role or drains."""
        if call.decode.role != "decode" or call.decode.draining:
            call.decode = self.decode.pick(call.route, {call.decode.url})
        call.decode_work = call.decode.lacking_tokens(call.route) or 0
        call.decode.outstanding += 1
        call.decode.outstanding_tokens += call.decode_work
        call.decode.requests += 1
        call.bound.bound -= 1
        call.bound = None
        return call.decode

    def answered(self, call: Call) -> None:
        """D's answer ended."""
        call.decode.outstanding -= 1
        call.decode.outstanding_tokens -= call.decode_work

    def switch(self, url: str, role: str) -> bool:
        """The instance moves to `role`'s pool (as `Fleet.set_role`); whether it moved."""
        instance = next((i for i in self.instances if i.url == url), None)
        if instance is None or instance.role == role:
            return False
        pools = {"prefill": self.prefill, "decode": self.decode}
        pools[instance.role].remove(instance)
        pools[role].add(instance)
        return True

    def admin_state(self) -> dict:
        """`GET /admin/instances` as far as pd planner reads it."""
        return {"instances": [i.state() | {"leaving": False} for i in self.instances], "arrivals": self.arrivals,
                "queue_waiting": 0}
