"""benchmarks/serve.py's progress: the requests done go to stderr, as plain lines with
counts when stderr is not a terminal; stdout is left to the result."""

from __future__ import annotations

import asyncio
import json

import httpx

from benchmarks.datasets import SampleRequest
from benchmarks.serve import build_payload, run_requests


def answer(request: httpx.Request) -> httpx.Response:
    chunks = [{"choices": [{"index": 0, "text": " t"}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
    return httpx.Response(200, content="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")


def test_requests_done_are_plain_lines_on_stderr_off_a_terminal(capsys) -> None:
    samples = [SampleRequest([100 + i, 200], 2, 1) for i in range(20)]

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            payloads = [build_payload("/v1/completions", "m", s, True) for s in samples]
            return await run_requests(client, "http://127.0.0.1:1/v1/completions", payloads, samples,
                                      [0.0] * len(samples), 4, label="live")

    records, _ = asyncio.run(run())
    assert all(r.success for r in records)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and "\r" not in err
    assert lines[0].startswith("bench serve live: 2/20 requests (10%, ")
    assert lines[-1].startswith("bench serve live: 20/20 requests (100%) in ")
    assert len(lines) == 10
