"""The keys of `kv_transfer_params` that the proxy reads or writes. The server decodes the
whole object into msgspec types (pd/kv_transfer/params.py) whose fields carry the same
names; tests/wire/test_contract.py holds the two equal."""

from __future__ import annotations

KV_TRANSFER_PARAMS = "kv_transfer_params"  # the body field of a request and of a server's answer
DO_REMOTE_DECODE = "do_remote_decode"  # proxy -> P: prefill and keep the blocks for a decode server
DO_REMOTE_PREFILL = "do_remote_prefill"  # P -> proxy -> D: the blocks are held on P
PREFIX = "prefix"  # proxy -> P: a decode server's parameters for a prefix P reads from it
REMOTE_REQUEST_ID = "remote_request_id"  # P's id for the held blocks (also POST /v1/kv/release's body)
SIGNATURE = "signature"  # P's signature over the parameters (also POST /v1/kv/release's body)
