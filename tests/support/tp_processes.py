"""Processes of a tensor-parallel server, for the TP tests: an engine's ranks found in
/proc, and a stream that runs until a fault ends it."""

from __future__ import annotations

from pathlib import Path

from launch import http_client


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), from /proc."""
    out, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            out.extend(children)
            stack.extend(children)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def rank_pids(engine_pid: int) -> list[int]:
    """The engine's tensor-parallel rank processes (its spawned children)."""
    return [p for p in descendants(engine_pid)
            if b"pd.worker.tp_ranks" in Path(f"/proc/{p}/cmdline").read_bytes() and alive(p)]


def stream_until_error(server, engine_pid: int, hurt) -> list[str]:
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with http_client().stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        hurt()
        return [line for line in lines if line.startswith("data: ")]
