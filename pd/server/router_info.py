"""What a KV-aware router asks a server (behind the API key, like /v1/models):

- `GET /v1/kv_config`: how this server names its KV blocks (the chained hash of
  kv_events/, the block size of each KV cache group, the group to route on) and where
  it publishes its KV events (absent without `--kv-events-port`);
- `POST /v1/tokenize`: a completions or chat body's prompt as the engine would get it,
  `{"tokens": [...], "count": n}` (chat: the template applied, with the tools).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from kv_events.hashing import HASH_NAME
from pd.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from pd.server.serving import Server
from wire.body import read_body


def router_info_routes(server: Server) -> APIRouter:
    router = APIRouter()

    @router.get("/kv_config")
    async def kv_config() -> dict[str, Any]:
        info = server.client.info
        groups = [{"id": i, "kind": name.partition(":")[2], "block_size": size}
                  for i, (name, size) in enumerate(zip(info.group_names, info.block_sizes))]
        routing = next((g["id"] for g in groups if g["kind"] == "full_attention"), 0)
        return {"engine_id": info.engine_id, "hash": HASH_NAME, "groups": groups, "routing_group": routing,
                "events": info.kv_events, "compat_hash": info.compat_hash}

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await read_body(request, server.limits.max_request_bytes)

        def tokens() -> list[int]:
            peeked = _peek(raw)
            chat = isinstance(peeked, dict) and "messages" in peeked
            return server.tokenize(parse_body(raw, ChatCompletionRequest if chat else CompletionRequest))

        ids = await server.off_loop(tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    return router


def _peek(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return None
