"""Where each request's prompt tokens came from: computed here, the local prefix cache,
another server (a remote prefill, or a prefix read from a decode server) or an offload
tier (host, disk); counted once per request, when it first runs, for the server's
totals and the request's own `prompt_sources`."""

from __future__ import annotations

from pd.contracts.request import Request, RequestStatus


class PromptSources:
    def __init__(self) -> None:
        self.counts = {"computed": 0, "local_cache": 0, "remote": 0}
        self._counted: set[str] = set()  # requests counted, until they finish

    def count(self, request: Request, num_hit: int, num_external: int) -> None:
        """At admission: `num_hit` tokens from the local prefix cache, `num_external`
        from outside; a request whose remote KV landed brings what it was parked with."""
        if request.request_id in self._counted:
            return
        self._counted.add(request.request_id)
        if request.status is RequestStatus.WAITING and request.num_computed_tokens:  # its remote KV landed
            num_hit, num_external = request.num_cached_tokens, request.num_computed_tokens - request.num_cached_tokens
        prompt = request.num_prompt_tokens
        num_external = min(num_external, prompt - num_hit)
        sources = {"computed": prompt - num_hit - num_external, "local_cache": num_hit}
        if num_external:
            sources[request.kv_loaded_from or "remote"] = num_external  # another server's KV, or a tier's
        request.prompt_sources = sources
        for source, tokens in sources.items():
            self.counts[source] = self.counts.get(source, 0) + tokens

    def forget(self, request_id: str) -> None:
        self._counted.discard(request_id)
