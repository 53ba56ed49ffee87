"""The proxy <-> server wire contract: what the two sides of the HTTP hop between the
proxy and a prefill or decode server must spell the same, in one place. The proxy and
`pd` both import it; it imports nothing of ours (starlette only, for the body reader).

- `codes.py`: the `error.code` values a server answers with and the proxy acts on.
- `headers.py`: the header names both sides read or write.
- `kv_params.py`: the keys of `kv_transfer_params` the proxy reads or writes (the server's
  msgspec types, pd/kv_transfer/params.py, declare the same fields; a test holds them equal).
- `errors.py`: OpenAI's JSON error body and the exception that carries it to an app's handler.
- `body.py`: a request body read up to a limit (413 past it).

No literal of this contract is written outside this package (tests/wire/test_contract.py).
"""
