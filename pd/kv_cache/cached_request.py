"""What the KV cache reads of a request: `pd.contracts.request.Request` is one. The KV
core depends on this protocol, not on the request, so it sits below the request's
lifecycle (the scheduler, its PD part) and knows nothing of sampling or PD fields."""

from __future__ import annotations

from typing import Protocol

from kv_events.hashing import BlockHash


class CachedRequest(Protocol):
    request_id: str
    num_computed_tokens: int  # tokens whose KV is in its blocks
    writes_prefix_cache: bool  # False: its blocks never enter the prefix cache

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""

    @property
    def reads_prefix_cache(self) -> bool:
        """False: it gets no prefix-cache hit (every prompt token is computed)."""

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        """The chained hashes of its full blocks of `block_size` tokens."""
