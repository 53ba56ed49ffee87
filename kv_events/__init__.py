"""The KV cache's public wire format: how blocks are named, and the events in which a
server says which blocks it holds. What a router needs to follow servers' prefix caches,
with no code of the engine's (the proxy imports only this package of the engine's side).

Block names (`hashing.py`): the token ids of a prompt are cut into blocks of the
server's block size (`GET /kv_config` says it, per KV cache group). Block i's hash is
    sha256(parent || pack("<I{n}q", n, *tokens) || pack("<I", len(extra)) || extra)
where parent is block i-1's hash (for block 0, sha256(b"pd prefix cache root v1")), n the
block size, tokens its n token ids as little-endian int64, and extra the request's
`cache_salt` (UTF-8) for block 0 and empty for the others. Only full blocks are named.
Equal hashes mean equal whole prefixes.

Events (`messages.py`, msgpack): a server started with `--kv-events-port P` publishes on
a ZMQ PUB socket at tcp://host:P one `EventBatch` per engine step that changed its
prefix cache: blocks entered (`BlockStored`), evicted (`BlockRemoved`) or all dropped
(`AllBlocksCleared`), numbered consecutively from 1 under the engine's id (a restarted
server has a new id and starts again from 1). A ZMQ ROUTER at tcp://host:P+1 (or
`--kv-events-replay-port`) answers a `ReplayRequest(start_seq)` with the batches from
that number on, or, when they are no longer kept, with one snapshot batch holding every
block cached now. A subscriber that sees a gap in the numbers asks for a replay.
Stored and removed blocks name their `medium`: "device" (the KV cache itself) or an
offload tier ("disk"; "host" is reserved); a block may be held in several at once.
"""
